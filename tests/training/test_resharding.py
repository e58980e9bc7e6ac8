"""Resuming `mea-pretrain` at another parallel layout keeps model, optimizer and scheduler state.

One spawned world of two processes per variant: a run stopped after step 6 at TP=1 PP=1 EP=1
(DP=2) is resumed, in the same processes, at the same layout (the reference) and at PP=2,
TP=2+SP and EP=2; each resumed run first saves its freshly loaded state again, at its own layout,
then trains steps 7-9. Checked: the following losses equal the same-layout resume's, and the
re-saved checkpoints hold the saved tensors bit for bit (model, Adam moments, step, scheduler).
A resume with a fresh optimizer (`--no-load-optim`) shows how far off a lost optimizer puts the
run, and the same processes probe Megatron-LM's learning-rate-schedule rules.
"""

import logging
import math
import os

import pytest
import torch
from megatron.core import dist_checkpointing

from tests._dist import run_distributed
from tests._models import read_checkpoint_tensors, tiny_flags

pytestmark = pytest.mark.slow

TINY = tiny_flags(moe_layer_freq="[0,1]", mock_data=True, eval_interval=None, eval_iters=0,
                  train_iters=9, lr=3e-3, min_lr=3e-4)
VARIANTS = {
    # Virtual heads (1 component for 2 groups; at TP=2 both ranks hold the component) and the
    # `weights` exchange (HLC folded into linear_qkv).
    "mea": ["--attention-variant", "mea", "--mea-num-kv-components", "1",
            "--mea-tp-exchange", "weights"],
    "kha": ["--attention-variant", "kha"],
    # Per-layer variants: a standard layer 1 and an MEA layer 2 with virtual heads; under PP=2
    # each stage builds one of them.
    "mea-per-layer": ["--attention-variant", "mea", "--attention-variant-per-layer", "standard",
                      "mea", "--mea-num-kv-components-per-layer", "2", "1"],
}
LAYOUTS = {
    "same": [],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "pp2-fresh-optimizer": ["--pipeline-model-parallel-size", "2", "--no-load-optim"],
}
SAVED_AT = 6


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _resume_everywhere(rank, world_size, base, saved, resaved, probe_schedule):
    """Train to step 6 and save; then resume at every layout of LAYOUTS (re-save, train)."""
    from megatron.core import parallel_state

    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import Trainer, pretrain
    from megatron_mea.checkpoint.torch_dist.checks import CheckpointError

    log = _Lines()
    logging.getLogger("megatron_mea.checkpoint.torch_dist.training_state").addHandler(log)
    logging.getLogger("megatron_mea.checkpoint.torch_dist.training_state").setLevel(logging.INFO)
    pretrain(*parse_run([*base, "--save", saved, "--exit-interval", str(SAVED_AT)]))
    results = {}
    for name, flags in LAYOUTS.items():
        del log.lines[:]
        trainer = Trainer(*parse_run([*base, "--load", saved, *flags]))
        try:
            trainer.save(os.path.join(resaved, name))
            history = trainer.train()
        finally:
            parallel_state.destroy_model_parallel()
        results[name] = dict(
            losses=[record["lm loss"] for record in history],
            lrs=[record["lr"] for record in history],
            log=[line for line in log.lines if line.startswith("loaded checkpoint")],
        )
    if probe_schedule:
        results["schedule"] = _probe_schedule(base, saved, parse_run, Trainer, CheckpointError,
                                              log)
        del log.lines[:]
        trainer = Trainer(*parse_run([*base, "--load", saved, "--adam-beta2", "0.99"]))
        parallel_state.destroy_model_parallel()
        results["betas"] = dict(
            betas=[tuple(group["betas"]) for group in trainer.optimizer.param_groups],
            log=[line for line in log.lines if "kept over" in line],
        )
        results["legacy"] = _probe_legacy(base, saved + "-legacy", parse_run, Trainer,
                                          CheckpointError)
    return results


def _probe_legacy(base, legacy, parse_run, Trainer, CheckpointError):
    """A checkpoint in the earlier format (no content metadata, so a ChainedOptimizer prefixes
    its optimizers' keys with chained_N.) saved at EP=2, where the expert parameters have an
    optimizer of their own, loaded at EP=1, where they do not: refused, with the way out."""
    from megatron.core import parallel_state

    from megatron_mea.checkpoint.torch_dist import training_state

    current = training_state.sharded_state_dict_metadata
    training_state.sharded_state_dict_metadata = lambda *args, **kwargs: {
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    try:
        trainer = Trainer(*parse_run([*base, "--expert-model-parallel-size", "2"]))
        trainer.save(legacy)
    finally:
        training_state.sharded_state_dict_metadata = current
        parallel_state.destroy_model_parallel()
    try:
        Trainer(*parse_run([*base, "--load", legacy]))
        return "loaded"
    except CheckpointError as exc:
        return str(exc)
    finally:
        parallel_state.destroy_model_parallel()


def _probe_schedule(base, saved, parse_run, Trainer, CheckpointError, log):
    """What a resume with another schedule (--train-iters 12: decay over 12 steps, not 9) and
    another global batch size (16, not 8) does without and with Megatron-LM's two flags."""
    from megatron.core import parallel_state

    probes = {}
    for name, flags in {
        "plain": [],
        "override": ["--override-opt_param-scheduler"],
        "use-checkpoint": ["--use-checkpoint-opt_param-scheduler"],
    }.items():
        argv = [*base, "--load", saved, "--train-iters", "12", "--global-batch-size", "16",
                *flags]
        del log.lines[:]
        try:
            scheduler = Trainer(*parse_run(argv)).scheduler
            probes[name] = dict(num_steps=scheduler.num_steps,
                                lr_decay_steps=scheduler.lr_decay_steps)
            probes[name + "-log"] = [line for line in log.lines
                                     if "global batch size" in line or "loaded" in line]
        except CheckpointError as exc:
            probes[name] = dict(error=str(exc))
        finally:
            parallel_state.destroy_model_parallel()
    return probes


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def resumed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"reshard-{request.param}")
    base = [*TINY, *VARIANTS[request.param], "--data-cache-path", str(root / "cache")]
    saved, resaved = str(root / "saved"), str(root / "resaved")
    results = run_distributed(
        _resume_everywhere, 2, base, saved, resaved, request.param == "mea"
    )
    for name in LAYOUTS:  # every rank reports the same (reduced) losses
        assert results[0][name]["losses"] == results[1][name]["losses"]
    return dict(variant=request.param, results=results[0], saved=saved, resaved=resaved)


@pytest.mark.parametrize("layout", ["pp2", "tp2-sp", "ep2"])
def test_resume_at_another_layout_continues_like_a_same_layout_resume(resumed, layout):
    same, other = resumed["results"]["same"]["losses"], resumed["results"][layout]["losses"]
    assert len(same) == len(other) == 9 - SAVED_AT
    difference = max(abs(a - b) for a, b in zip(same, other))
    print(f"{resumed['variant']} {layout}: max |loss - same-layout loss| = {difference:.2e}")
    assert difference < 1e-5, (same, other)
    assert resumed["results"][layout]["lrs"] == pytest.approx(
        resumed["results"]["same"]["lrs"], rel=1e-12
    )


def test_a_fresh_optimizer_would_show_in_those_losses(resumed):
    # The power of the 1e-5 check: losing the optimizer (and, as in Megatron-LM, the scheduler)
    # moves step 9 by far more.
    same = resumed["results"]["same"]["losses"]
    fresh = resumed["results"]["pp2-fresh-optimizer"]["losses"]
    assert abs(same[0] - fresh[0]) < 1e-5  # step 7: the loaded weights, before any update
    assert abs(same[-1] - fresh[-1]) > 1e-3, (same, fresh)


def _common_step(tree):
    if isinstance(tree, dict):
        if "common_step" in tree:
            return float(tree["common_step"])
        for value in tree.values():
            step = _common_step(value)
            if step is not None:
                return step
    return None


@pytest.mark.parametrize("layout", ["same", "pp2", "tp2-sp", "ep2"])
def test_resharded_state_is_the_saved_state_bit_for_bit(resumed, layout):
    name = f"iter_{SAVED_AT:07d}"
    original = os.path.join(resumed["saved"], name)
    again = os.path.join(resumed["resaved"], layout, name)
    before, after = read_checkpoint_tensors(original), read_checkpoint_tensors(again)
    assert sorted(before) == sorted(after)
    optimizer_keys = [key for key in before if key.startswith("optimizer.state.")]
    kinds = {key.split(".")[2] for key in optimizer_keys}
    assert kinds == {"exp_avg", "exp_avg_sq"}, kinds
    assert any("head_mix" in key or "knock" in key for key in optimizer_keys)
    different = [key for key in before if not torch.equal(before[key], after[key])]
    assert not different, different
    common_before = dist_checkpointing.load_common_state_dict(original)
    common_after = dist_checkpointing.load_common_state_dict(again)
    assert _common_step(common_before["optimizer"]) == SAVED_AT
    assert _common_step(common_after["optimizer"]) == SAVED_AT
    assert common_after["opt_param_scheduler"] == common_before["opt_param_scheduler"]
    assert common_after["consumed_samples"] == common_before["consumed_samples"] == 48


def test_the_log_says_what_was_resharded(resumed):
    (line,) = resumed["results"]["pp2"]["log"]
    assert "saved at TP=1 PP=1 VPP=1 EP=1" in line and "DP=2" in line
    assert "this run TP=1 PP=2 VPP=1 EP=1" in line and "DP=1" in line
    assert "resharded by dist-ckpt: model, optimizer state (exp_avg, exp_avg_sq" in line
    assert "RNG state not restored" in line and "global sample 48" in line
    (line,) = resumed["results"]["ep2"]["log"]
    assert "EP=2" in line and "RNG state restored" in line  # same (PP, TP): RNG kept
    assert line.endswith("settings changed since the checkpoint: --expert-model-parallel-size "
                         "1 -> 2, --exit-interval 6 -> None")
    (line,) = resumed["results"]["same"]["log"]
    assert "loaded at the same layout" in line
    # The saving run stopped at --exit-interval 6; the resume runs on without one.
    assert line.endswith("settings changed since the checkpoint: --exit-interval 6 -> None")
    (line,) = resumed["results"]["pp2-fresh-optimizer"]["log"]
    assert "optimizer and learning-rate schedule start fresh (--no-load-optim)" in line


# The schedule probes run once, in the MEA world.
@pytest.mark.parametrize("resumed", ["mea"], indirect=True)
def test_no_load_optim_restarts_the_schedule_as_megatron_lm(resumed):
    # Megatron-LM's --no-load-optim skips the scheduler too: step 7 runs at the LR of a fresh
    # schedule's first step (no warm-up here: 5% of 9 steps rounds to 0), not of step 7.
    fresh = resumed["results"]["pp2-fresh-optimizer"]["lrs"]
    kept = resumed["results"]["same"]["lrs"]
    first_step_lr = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * 1 / 9))
    assert fresh[0] == pytest.approx(first_step_lr, rel=1e-9)
    assert kept[0] < fresh[0] * 0.8


@pytest.mark.parametrize("resumed", ["mea"], indirect=True)
def test_another_schedule_needs_megatron_lm_s_flags(resumed):
    probes = resumed["results"]["schedule"]
    message = probes["plain"]["error"]
    assert "lr_decay_steps 12 (from --train-iters), checkpoint 9" in message
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message
    assert probes["override"] == dict(num_steps=SAVED_AT, lr_decay_steps=12)
    assert probes["use-checkpoint"] == dict(num_steps=SAVED_AT, lr_decay_steps=9)


@pytest.mark.parametrize("resumed", ["mea"], indirect=True)
def test_another_global_batch_size_needs_megatron_lm_s_flags_and_is_stated(resumed):
    # Megatron-LM's schedule counts samples, so its scheduler check refuses this change; the
    # schedule here counts iterations, and the change used to pass without a word.
    probes = resumed["results"]["schedule"]
    assert ("; global_batch_size 16 (from --global-batch-size), checkpoint 8. Pass "
            "--override-opt_param-scheduler") in probes["plain"]["error"]
    for name in ("override", "use-checkpoint"):
        warning, summary = probes[f"{name}-log"]
        assert warning.endswith(
            "the global batch size changes from the checkpoint's 8 to 16 (--global-batch-size, "
            f"accepted with --{name}-opt_param-scheduler): each step from here reads 16 samples")
        # Every setting that differs from the checkpoint's (the saving run stopped at
        # --exit-interval 6; the resume runs on without one).
        assert summary.endswith("settings changed since the checkpoint: --global-batch-size "
                                "8 -> 16, --train-iters 9 -> 12, --exit-interval 6 -> None")


def test_distributed_optimizer_formats_follow_megatron_lm(single_rank):
    # The distributed optimizer needs CUDA (no CPU run here); its checkpoint metadata and the
    # refusal of what Megatron cannot reshard are checked directly.
    from megatron_mea.checkpoint.torch_dist.training_state import (
        optimizer_reshard_problem,
        sharded_state_dict_metadata,
    )

    plain = sharded_state_dict_metadata()
    assert plain["chained_optim_avoid_prefix"] is True
    assert plain["singleton_local_shards"] is False
    assert "distrib_optim_sharding_type" not in plain and plain["dp_cp_group"] is not None
    assert sharded_state_dict_metadata(True)["distrib_optim_sharding_type"] == "dp_reshardable"
    reshardable = sharded_state_dict_metadata(True, fully_reshardable=True)
    assert reshardable["distrib_optim_sharding_type"] == "fully_reshardable"
    assert reshardable["distrib_optim_fully_reshardable_mem_efficient"] is False

    dp_only = {"dp": (2, 4)}
    tp = {"tp": (1, 2), "dp": (2, 1)}
    for saved in (None, {}, plain, reshardable, {"distrib_optim_sharding_type":
                                                 "fully_sharded_model_space"}):
        assert optimizer_reshard_problem(saved, tp) is None
    dp_reshardable = {"distrib_optim_sharding_type": "dp_reshardable"}
    assert optimizer_reshard_problem(dp_reshardable, dp_only) is None
    assert optimizer_reshard_problem(dp_reshardable, {}) is None
    message = optimizer_reshard_problem(dp_reshardable, tp)
    assert "saved as 'dp_reshardable'" in message and "TP 1 -> 2" in message
    assert "--dist-ckpt-optim-fully-reshardable" in message and "--no-load-optim" in message
    assert "EP 1 -> 2" in optimizer_reshard_problem(dp_reshardable, {"ep": (1, 2)})
    assert "PP 2 -> 1" in optimizer_reshard_problem(dp_reshardable, {"pp": (2, 1)})


@pytest.mark.parametrize("resumed", ["mea"], indirect=True)
def test_optimizer_state_megatron_cannot_map_is_refused_not_reset(resumed):
    message = resumed["results"]["legacy"]
    assert "optimizer tensor 'optimizer.state." in message, message
    assert "is not in the checkpoint" in message and "--no-load-optim" in message


@pytest.mark.parametrize("resumed", ["mea"], indirect=True)
def test_optimizer_settings_come_from_the_checkpoint_with_a_warning(resumed):
    # As Megatron-LM, the checkpoint's param-group settings are kept; here it says so.
    betas = resumed["results"]["betas"]
    assert set(betas["betas"]) == {(0.9, 0.95)}
    (line,) = betas["log"]
    assert "betas (0.9, 0.95) (not (0.9, 0.99))" in line
