"""Pipeline parallelism in `mea-pretrain`: PP=2 and virtual pipeline stages compute what PP=1
computes, from the same weights (real gloo processes, Megatron's pipeline schedules).

Each world loads one checkpoint (written at PP=1 after one step) at every layout and, from it,
runs one step's forward and backward (loss and every parameter's reduced gradient, no update),
then trains on from the same position.
"""

import math
import re

import pytest
import torch

from tests._dist import run_distributed
from tests._models import read_checkpoint_tensors, tiny_flags

pytestmark = pytest.mark.slow

# 4 layers (dense, MoE, dense, MoE): at PP=2 each stage holds one of each; with one layer per
# virtual stage, stage 0 holds layers 0 and 2 (both dense) and stage 1 layers 1 and 3.
TINY = tiny_flags(num_layers=4, moe_layer_freq="[0,1,0,1]", micro_batch_size=2, mock_data=True,
                  eval_interval=None, eval_iters=0, train_iters=4, lr=3e-3, min_lr=3e-4)
VARIANTS = {
    # Virtual heads (1 component for 2 groups) with the `weights` exchange (folded, per-step
    # fold cache flushed in finalize_model_grads).
    "mea": ["--attention-variant", "mea", "--mea-num-kv-components", "1",
            "--mea-tp-exchange", "weights"],
    "kha": ["--attention-variant", "kha"],
}
PP2 = ["--pipeline-model-parallel-size", "2"]
VP2 = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _global_gradients(trainer) -> dict:
    """{parameter name in the PP=1 model: its reduced gradient} for this rank's parameters
    (TP=1, EP=1: every rank holds whole tensors)."""
    grads = {}
    for chunk in trainer.modules:
        layers = chunk.decoder.layers
        for name, param in chunk.named_parameters():
            match = _LAYER.match(name)
            if match:  # local layer index -> global (layer_number is 1-based and global)
                number = layers[int(match.group(1))].layer_number - 1
                name = f"decoder.layers.{number}." + name[match.end():]
            grads[name] = param.main_grad.detach().clone()
    return grads


def _from_the_same_weights(rank, world_size, base, ckpt, layouts):
    """Save after one step at `base`'s layout; then, per layout, load it, run one forward and
    backward (no update), rewind the data, train to the end and save (`<ckpt>-<layout>`)."""
    from megatron.core import parallel_state

    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import Trainer, pretrain

    pretrain(*parse_run([*base, "--save", ckpt, "--exit-interval", "1"]))
    results = {}
    for name, flags in layouts.items():
        trainer = Trainer(*parse_run([*base, "--load", ckpt, *flags]))
        try:
            start = trainer.consumed_samples
            loss = trainer.forward_backward()
            grads = _global_gradients(trainer)
            batches = trainer.train_batches
            for iterator in batches if isinstance(batches, list) else [batches]:
                iterator.consumed_samples = start
            history = trainer.train()
            trainer.save(f"{ckpt}-{name}")
        finally:
            parallel_state.destroy_model_parallel()
        results[name] = dict(
            loss=loss,
            grads=grads,
            losses=[record["lm loss"] for record in history],
            grad_norms=[record["grad norm"] for record in history],
        )
    return results


def _merged(results, name) -> dict:
    grads = {}
    for rank_results in results:
        grads.update(rank_results[name]["grads"])
    return grads


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pipelines(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pipeline-{request.param}")
    base = [*TINY, *VARIANTS[request.param], "--data-cache-path", str(root / "cache")]
    layouts = {"pp1": [], "pp2": PP2, "pp2-vp2": VP2}
    results = run_distributed(_from_the_same_weights, 2, base, str(root / "ckpt"), layouts)
    return request.param, results, root


@pytest.mark.parametrize("layout", ["pp2", "pp2-vp2"])
def test_pipeline_stages_compute_the_loss_and_every_gradient_of_pp1(pipelines, layout):
    variant, results, _ = pipelines
    reference, pipelined = results[0]["pp1"], results[0][layout]
    assert results[1][layout]["loss"] == pipelined["loss"]  # the loss is shared by all stages
    assert abs(pipelined["loss"] - reference["loss"]) < 1e-6, (pipelined["loss"], reference["loss"])
    ours, theirs = _merged(results, layout), _merged(results, "pp1")
    assert sorted(ours) == sorted(theirs)
    assert any("head_mix" in name or "knock" in name for name in ours)
    assert any("experts" in name for name in ours)
    worst = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    print(f"{variant} {layout}: |loss diff| {abs(pipelined['loss'] - reference['loss']):.1e}, "
          f"max |grad diff| {worst:.1e} over {len(ours)} parameters")
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7, msg=name)
    # Training on: the same losses and grad norms (the norm is reduced across the stages).
    assert len(pipelined["losses"]) == 3 and pipelined["losses"][0] == pytest.approx(
        pipelined["loss"], abs=1e-6)
    for ours_, theirs_ in (("losses", "losses"), ("grad_norms", "grad_norms")):
        difference = max(abs(a - b) for a, b in zip(pipelined[ours_], reference[theirs_]))
        assert difference < 1e-5, (ours_, pipelined[ours_], reference[theirs_])
    assert all(math.isfinite(v) for v in pipelined["losses"])


@pytest.mark.parametrize("layout", ["pp2", "pp2-vp2"])
def test_pipeline_checkpoints_hold_the_weights_and_optimizer_state_of_pp1(pipelines, layout):
    # Saved after training on (model chunks "model0", "model1" with virtual stages), under the
    # same global keys as at PP=1, with the same values up to float rounding.
    _, _, root = pipelines
    name = "iter_0000004"
    ours = read_checkpoint_tensors(root / f"ckpt-{layout}" / name)
    theirs = read_checkpoint_tensors(root / "ckpt-pp1" / name)
    assert sorted(ours) == sorted(theirs)
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)


def test_tensor_and_pipeline_parallel_world_of_four_trains_like_pp1(tmp_path):
    # TP=2 (+SP) x PP=2 on four processes, MEA with virtual heads and the weights exchange,
    # from the checkpoint a DP=4 run wrote after one step.
    base = [*TINY, *VARIANTS["mea"], "--data-cache-path", str(tmp_path / "cache")]
    layouts = {"pp1": [], "tp2-pp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      *PP2]}
    results = run_distributed(_from_the_same_weights, 4, base, str(tmp_path / "ckpt"), layouts)
    reference, parallel = results[0]["pp1"], results[0]["tp2-pp2"]
    assert abs(parallel["loss"] - reference["loss"]) < 1e-6, (parallel["loss"], reference["loss"])
    losses = max(abs(a - b) for a, b in zip(parallel["losses"], reference["losses"]))
    norms = max(abs(a - b) for a, b in zip(parallel["grad_norms"], reference["grad_norms"]))
    print(f"tp2-pp2: max |loss diff| {losses:.1e}, max |grad norm diff| {norms:.1e}")
    assert len(parallel["losses"]) == 3 and losses < 1e-5 and norms < 1e-5
    assert all(r["tp2-pp2"]["losses"] == parallel["losses"] for r in results)
