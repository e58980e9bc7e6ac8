"""`mea-bench-attention` (the installed console script) end to end at a tiny size: it times every
variant, and the bytes it counts at TP=2 and TP=4 (real gloo processes) equal
`parallel/exchange.py`'s formulas."""

import json
import os
import subprocess
import sys

import pytest

# The benchmark's byte accounting: application code, the same on every Megatron-Core release;
# tested with one.
pytestmark = [pytest.mark.slow, pytest.mark.one_release("0.16")]

# The console scripts are installed next to the interpreter running the tests.
SCRIPT = os.path.join(os.path.dirname(sys.executable), "mea-bench-attention")


def test_bench_attention_counts_the_formula_bytes_at_tp2_and_tp4(tmp_path):
    out = tmp_path / "bench.json"
    command = [
        SCRIPT,
        "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "4",
        "--seq-length", "32", "--repeats", "2", "--warmup", "0", "--model-layers", "1",
        "--model-repeats", "2",
        "--vocab-size", "128", "--tp-sizes", "2", "4", "--json", str(out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    variants = ["baseline", "mea-activations", "mea-weights", "kha-linear", "kha-linear-folded",
                "kha-mlp"]
    for key in ("layer", "model_step"):
        assert list(result[key]) == variants
        assert all(row["median_s"] > 0 and row["ratio"] > 0 for row in result[key].values())
    for tp in ("2", "4"):
        rows = result["bytes"][tp]
        assert all(rows[v]["matches_formula"] for v in variants), rows
        assert rows["mea-activations"]["ops"]["all_to_all_single"]["calls"] == 4  # 2 fwd, 2 bwd
        assert "all_to_all_single" not in rows["mea-weights"]["ops"]
        base, weights = rows["baseline"]["ops"], rows["mea-weights"]["ops"]
        # The fold: one all-gather of the K/V rows forward, one reduce-scatter backward.
        assert weights["all_gather_into_tensor"]["calls"] == base["all_gather_into_tensor"]["calls"] + 1
        assert weights["reduce_scatter_tensor"]["calls"] == base["reduce_scatter_tensor"]["calls"] + 1
        assert rows["mea-activations"]["extra_bytes"] > 0
    assert "collectives of one layer forward + backward, TP=4" in run.stdout


def test_collective_counter_restores_torch_and_megatron_on_exit():
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from megatron_mea.parallel.comm_counter import CollectiveCounter

    originals = (dist.all_to_all_single, dist.all_reduce, mappings.dist_all_gather_func)
    with CollectiveCounter():
        assert dist.all_reduce is not originals[1]
        assert mappings.dist_all_gather_func is not originals[2]  # Megatron's import-time alias
    assert (dist.all_to_all_single, dist.all_reduce, mappings.dist_all_gather_func) == originals
