"""KHA-Linear on MLA under tensor (+sequence) and expert parallelism equals TP=1 in loss and every
gradient; its matrices stay replicated; checkpoints reshard exactly. Real processes on gloo."""

import pytest

from tests._dist import run_distributed
from tests.distributed import _mla_workers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "tp,ep,sp", [(2, 1, True), (1, 2, False)], ids=["tp2-sp", "ep2"]
)
def test_kha_mla_parallel_equals_tp1_in_loss_and_every_gradient(tmp_path, tp, ep, sp):
    results = run_distributed(_mla_workers.equivalence, 2, tp, ep, sp, str(tmp_path))
    for r in results:
        diff = (r["losses"] - r["ref_losses"]).abs().max().item()
        assert diff < 1e-5, f"loss differs from TP=1 by {diff}"
        bad = {n: d for n, d in r["grad_diff"].items() if d > 1e-5 * max(1.0, r["grad_scale"])}
        assert not bad, f"gradients differ from TP=1: {bad}"
        knock = [n for n in r["grad_diff"] if ".knock." in n]
        experts = [n for n in r["grad_diff"] if ".experts." in n]
        assert len(knock) == 2 * 3 and experts, "the knock or expert gradients were not compared"
        # Replicated (whole, unsharded) on every rank, with bit-identical gradients.
        assert set(r["knock_shapes"].values()) == {(16, 16), (12, 12)}
        assert r["replicas"] and all(r["replicas"].values()), r["replicas"]


def test_kha_mla_checkpoint_tp2_sp_to_tp1_to_tp2_round_trip_is_exact(tmp_path):
    results = run_distributed(_mla_workers.checkpoint_round_trip, 2, str(tmp_path))
    for r in results:
        assert r["same_keys"] and r["same_state"]
        assert len(r["knock_keys"]) == 2 * 3
        assert (r["loss_first"] == r["loss_last"]).all()
        assert (r["loss_first"] - r["loss_middle"]).abs().max() < 1e-5
