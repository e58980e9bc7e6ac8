"""`mea-reproduce` in its smoke form: both studies through `mea-lr-sweep` at a tiny size (one run
each: MEA and KHA-MLP, 3 steps), and the report with its tables and plots."""

import os

import pytest

from tests.training.test_lr_sweep import TINY

# The reproduction driver: application code, the same on every Megatron-Core release; tested with
# one.
pytestmark = [pytest.mark.slow, pytest.mark.one_release("0.16")]


def test_smoke_run_writes_the_report_with_both_studies(tmp_path):
    from megatron_mea.apps.sweeps.reproduce import STUDIES
    from megatron_mea.cli.reproduce import main
    from megatron_mea.data import build_stdlib_corpus, build_tokenizer, preprocess_files

    corpus = str(tmp_path / "corpus.jsonl")
    build_stdlib_corpus(corpus, max_bytes=100_000)
    prefix = str(tmp_path / "corpus_text_document")
    preprocess_files([corpus], prefix, build_tokenizer("ByteLevelTokenizer"), append_eod=True,
                     progress=False)
    sets = [item for item in TINY if item.startswith("--set=")]
    out, report = str(tmp_path / "out"), str(tmp_path / "report")
    argv = ["--smoke", "--out", out, "--report-dir", report, "--data-path", prefix,
            "--train-iters", "3", *sets]
    assert main(argv) == 0
    text = open(os.path.join(report, "report.md"), encoding="utf-8").read()
    for name, study in STUDIES.items():
        assert f"## {study.title}" in text and study.source in text
        assert f"| {study.variants[-1]} |" in text
        for plot in ("loss_vs_step.png", "final_loss_vs_lr.png"):
            target = f"{name}_seed{study.seeds[0]}_{plot}"
            assert f"]({target})" in text and os.path.getsize(os.path.join(report, target)) > 0
    assert "LR 0.0001" in text and "| 0.003 | kha-mlp |" in text
    # The study's own settings reached the runs: a constant LR for MEA's, QK norm for KHA's.
    mea = open(os.path.join(out, "mea-lr", "seed1234", "train.yaml"), encoding="utf-8").read()
    kha = open(os.path.join(out, "kha", "seed1234", "train.yaml"), encoding="utf-8").read()
    assert "lr_decay_style: constant" in mea and "qk_layernorm: true" in kha
    # Rerunning keeps every finished run.
    assert main(argv) == 0


def test_every_run_of_the_full_studies_passes_mea_pretrain_validation(tmp_path):
    from megatron_mea.apps.sweeps.runs import prepare_sweep
    from megatron_mea.apps.sweeps import lr_sweep
    from megatron_mea.apps.sweeps.reproduce import STUDIES, sweep_argv
    from megatron_mea.cli.reproduce import build_parser
    from megatron_mea.data import ByteLevelTokenizer, preprocess_files

    (tmp_path / "data.jsonl").write_text("".join('{"text": "doc %d"}\n' % i for i in range(1000)))
    preprocess_files([str(tmp_path / "data.jsonl")], str(tmp_path / "data"), ByteLevelTokenizer(),
                     append_eod=True, progress=False)
    args = build_parser().parse_args(["--out", str(tmp_path / "out")])
    for name, study in STUDIES.items():
        for seed in study.seeds:
            sweep = lr_sweep.build_parser().parse_args(
                sweep_argv(args, name, seed, [str(tmp_path / "data")]))
            settings, _ = lr_sweep.resolve(sweep)
            assert (settings.variants, settings.lrs) == (list(study.variants), list(study.lrs))
            assert settings.train_config["seed"] == seed
            prepare_sweep(settings, lambda path, s=settings: lr_sweep.check_commands(s, path))
    # The MEA study's schedule has the paper's shape: 40 % warm-up (1,000 of 2,500), constant.
    assert STUDIES["mea-lr"].settings == {"lr_decay_style": "constant", "lr_warmup_fraction": 0.4}
    assert STUDIES["mea-lr"].lrs == (1e-4, 5e-4, 1e-3, 3e-3)
