"""The LR sweep: spike / divergence definitions on constructed curves, the "largest stable LR",
the presets against mea-pretrain's validation, and a real resumable sweep end to end."""

import json
import math
import os
from functools import partial

import pytest

from megatron_mea.apps.sweeps.sweep import (
    VARIANTS,
    RunSummary,
    StabilityRule,
    find_divergence,
    find_spikes,
    largest_stable_lr,
    summarize_run,
)

# The LR-sweep driver (grid, resumption, verdicts, plots): application code, the same on every
# Megatron-Core release; tested with one.
pytestmark = [pytest.mark.slow, pytest.mark.one_release("0.16")]

RULE = StabilityRule(spike_threshold=0.2, spike_window=20, smooth_window=10,
                     divergence_factor=1.0, divergence_rise=0.5)


def _curve(n=200, start=6.0, floor=3.0, tau=20.0):
    """A clean, decaying loss curve: start -> floor."""
    return [floor + (start - floor) * math.exp(-i / tau) for i in range(n)]


def _records(losses):
    return [{"iteration": i + 1, "lm loss": v, "grad norm": 1.0} for i, v in enumerate(losses)]


def test_spikes_are_counted_once_per_excursion_after_warmup():
    losses = _curve()
    losses[4] *= 1.5  # during warm-up: ignored
    for i in (60, 61, 62):  # one excursion of three steps
        losses[i] *= 1.5
    losses[120] *= 1.3  # a second, one-step spike
    losses[150] *= 1.1  # below the 20 % threshold
    spikes = find_spikes(range(1, 201), losses, RULE, warmup_steps=10)
    assert spikes == [61, 121]


def test_a_jump_that_stays_up_is_one_open_excursion():
    losses = _curve(100) + [6.0] * 50
    assert find_spikes(range(1, 151), losses, RULE, warmup_steps=10) == [101]


def test_clean_curve_has_no_spike_and_does_not_diverge():
    losses = _curve()
    assert find_spikes(range(1, 201), losses, RULE, warmup_steps=10) == []
    assert find_divergence(range(1, 201), losses, RULE, warmup_steps=10) == (None, "")


@pytest.mark.parametrize(
    "edit, at, reason",
    [
        (lambda l: l.__setitem__(150, math.nan), 151, "non-finite"),
        # from iteration 101 at 7.0: the 10-step mean passes 6.0 at 108 (8 x 7.0 + 2 x ~3.0)
        (lambda l: l.__setitem__(slice(100, 200), [7.0] * 100), 108, "initial loss"),
        (lambda l: l.__setitem__(slice(180, 200), [5.0] * 20), 200, "best loss"),
    ],
    ids=["nan", "back-above-initial-loss", "did-not-recover"],
)
def test_divergence_criteria(edit, at, reason):
    losses = _curve()
    edit(losses)
    diverged_at, why = find_divergence(range(1, 201), losses, RULE, warmup_steps=10)
    assert diverged_at == at and reason in why, why


def test_warmup_excursion_above_the_initial_loss_is_not_divergence():
    losses = _curve()
    losses[2:6] = [9.0] * 4
    assert find_divergence(range(1, 201), losses, RULE, warmup_steps=20)[0] is None


def test_trainer_stop_is_divergence_and_leaves_no_final_loss():
    summary = summarize_run("mea", 1e-2, _records(_curve(50)), 200, 10, RULE,
                            stop_message="iteration 51: non-finite lm loss (nan)")
    assert summary.status == "stopped" and summary.diverged and summary.diverged_at == 51
    assert math.isnan(summary.final_loss) and summary.best_loss < 4.0


def test_summary_of_a_finished_and_an_unfinished_run():
    losses = _curve()
    done = summarize_run("baseline", 1e-3, _records(losses), 200, 10, RULE)
    assert done.status == "completed" and not done.diverged and done.spikes == []
    assert done.final_loss == pytest.approx(sum(losses[-10:]) / 10)
    assert done.best_loss == pytest.approx(done.final_loss)
    partial = summarize_run("baseline", 1e-3, _records(losses[:50]), 200, 10, RULE)
    assert partial.status == "incomplete" and partial.steps == 50


def _summary(variant, lr, diverged=False, spikes=(), status="completed"):
    return RunSummary(variant, lr, status, 100, 3.0, 3.0, math.nan, 1.0, list(spikes), diverged,
                      100 if diverged else None, "")


def test_largest_stable_lr_is_the_largest_finished_lr_that_did_not_diverge():
    runs = [
        _summary("baseline", 1e-3), _summary("baseline", 3e-3, spikes=[40, 70]),
        _summary("baseline", 1e-2, diverged=True),
        # an unstable LR below a stable one does not lower the answer (the table shows it)
        _summary("mea", 1e-3, diverged=True), _summary("mea", 3e-3), _summary("mea", 1e-2),
        _summary("kha-mlp", 1e-3, diverged=True),
        _summary("kha-linear", 1e-3), _summary("kha-linear", 1e-2, status="incomplete"),
    ]
    assert largest_stable_lr(runs, RULE) == {
        "baseline": 3e-3, "mea": 1e-2, "kha-mlp": None, "kha-linear": 1e-3,
    }
    strict = StabilityRule(max_spikes=1)
    assert largest_stable_lr(runs, strict)["baseline"] == 1e-3


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_every_preset_run_passes_mea_pretrain_validation(preset, tmp_path):
    from megatron_mea.apps.sweeps.runs import prepare_sweep
    from megatron_mea.apps.sweeps.lr_sweep import build_parser, check_commands, resolve

    # Validation reads the dataset's index: a real one, with documents for every split.
    from megatron_mea.data import ByteLevelTokenizer, preprocess_files

    (tmp_path / "data.jsonl").write_text("".join('{"text": "doc %d"}\n' % i for i in range(1000)))
    preprocess_files([str(tmp_path / "data.jsonl")], str(tmp_path / "data"), ByteLevelTokenizer(),
                     append_eod=True, progress=False)
    args = build_parser().parse_args(
        ["--preset", preset, "--out", str(tmp_path / "out"), "--data-path", str(tmp_path / "data")]
    )
    settings, _ = resolve(args)
    assert settings.variants == list(VARIANTS)
    prepare_sweep(settings, partial(check_commands, settings))


def test_gpu_preset_has_the_shape_of_the_papers_lr_study(tmp_path):
    """Warm-up then constant LR, warm-up 40% of the run (1,000 of 2,500 steps in the paper); the
    spike and divergence criteria start after it."""
    from megatron_mea.apps.sweeps.lr_sweep import PRESETS, build_parser, resolve

    config = PRESETS["gpu"]["train_config"]
    assert config["lr_decay_style"] == "constant"
    assert config["lr_warmup_iters"] / config["train_iters"] == pytest.approx(1000 / 2500)
    args = build_parser().parse_args(["--preset", "gpu", "--out", str(tmp_path / "out"),
                                      "--data-path", "x"])
    assert resolve(args)[0].warmup_steps == config["lr_warmup_iters"]


def test_the_sweep_has_the_papers_controls():
    """Baseline, +norm, +HLC, HLC + norm; the norm-only run has no mixing matrices."""
    from megatron_mea.apps.training.arguments import parse_args
    from megatron_mea.model.gpt import transformer_config

    for name, (hlc, norm) in {"mea-norm-only": (False, True), "mea-no-norm": (True, False),
                              "mea": (True, True)}.items():
        config = transformer_config(parse_args([*VARIANTS[name], "--mock-data"]))
        assert (config.mea_hlc, config.mea_head_norm) == (hlc, norm), name


TINY = [
    "--variants", "baseline", "mea", "--lrs", "3e-3", "1e30", "--train-iters", "6",
    "--save-interval", "3",
    *[f"--set={kv}" for kv in (
        "num_layers=2", "hidden_size=64", "ffn_hidden_size=128", "num_attention_heads=4",
        "num_query_groups=2", "seq_length=64", "num_experts=null", "micro_batch_size=4",
        "global_batch_size=8", "eval_iters=1", "split=90,10,0", "log_interval=1",
    )],
]


def _iterations_and_losses(directory):
    with open(os.path.join(directory, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    return [r["iteration"] for r in records], [r["lm loss"] for r in records]


def test_sweep_end_to_end_resumes_an_interrupted_run_and_keeps_finished_ones(tmp_path, capsys):
    from megatron_mea.apps.sweeps.runs import run_dir
    from megatron_mea.cli.lr_sweep import main
    from megatron_mea.data import build_stdlib_corpus, build_tokenizer, preprocess_files

    corpus = str(tmp_path / "corpus.jsonl")
    build_stdlib_corpus(corpus, max_bytes=200_000)
    prefix = str(tmp_path / "corpus_text_document")
    preprocess_files([corpus], prefix, build_tokenizer("ByteLevelTokenizer"), append_eod=True,
                     progress=False)
    out = str(tmp_path / "sweep")
    argv = ["--out", out, "--data-path", prefix, *TINY]

    assert main(argv) == 0
    summary = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
    runs = {(r["variant"], r["lr"]): r for r in summary["runs"]}
    # The absurd LR overflows to NaN; the trainer stops (nan_policy=stop) and the sweep goes on.
    for variant in ("baseline", "mea"):
        assert runs[(variant, 3e-3)]["status"] == "completed"
        assert not runs[(variant, 3e-3)]["diverged"]
        assert runs[(variant, 1e30)]["status"] == "stopped" and runs[(variant, 1e30)]["diverged"]
    assert summary["largest_stable_lr"] == {"baseline": 3e-3, "mea": 3e-3}
    # The loss-law fit sits beside each verdict; 6 steps are too few to fit.
    assert summary["fit"]["min_steps"] == 50 and summary["fit"]["tokens_per_step"] > 0
    assert all(r["fit"] is None for r in summary["runs"])
    for name in ("summary.txt", "loss_vs_step.png", "final_loss_vs_lr.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0

    # Interrupt one run after its step-3 checkpoint: steps 4-6 were logged but not saved.
    victim = run_dir(out, "mea", 3e-3)
    steps, losses = _iterations_and_losses(victim)
    assert steps == [1, 2, 3, 4, 5, 6]
    os.remove(os.path.join(victim, "result.json"))
    os.rename(os.path.join(victim, "iter_0000006"), os.path.join(tmp_path, "moved_iter_6"))
    with open(os.path.join(victim, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("3")
    kept = {d: open(os.path.join(d, "result.json")).read()
            for d in (run_dir(out, "baseline", 3e-3), run_dir(out, "baseline", 1e30),
                      run_dir(out, "mea", 1e30))}

    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished earlier, kept") == 3
    resumed = json.load(open(os.path.join(victim, "result.json"), encoding="utf-8"))
    assert resumed["resumed_from"] == 3 and "--load" in resumed["command"]
    # Steps 4-6 once each, and the same losses as before the interruption (exact CPU resume).
    assert _iterations_and_losses(victim) == (steps, losses)
    for directory, text in kept.items():
        assert open(os.path.join(directory, "result.json")).read() == text

    # Other training settings in the same directory are refused (the runs would not compare).
    assert main([*argv, "--set", "seed=7"]) == 2
    # Re-judging needs no settings: they are read from the directory.
    capsys.readouterr()
    assert main(["--out", out, "--summary-only", "--max-spikes", "0"]) == 0
    assert "<= 0 spikes" in capsys.readouterr().out
    assert main(["--out", out, "--summary-only", "--fit-min-steps", "3",
                 "--predict-tokens", "1e9"]) == 0
    summary = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
    assert summary["fit"]["predict_tokens"] == 1e9
    fits = {(r["variant"], r["lr"]): r["fit"] for r in summary["runs"]}
    assert fits[("mea", 1e30)] is None  # stopped on NaN at once: nothing to fit
    assert all(f is None or f["predict_tokens"] == 1e9 for f in fits.values())
