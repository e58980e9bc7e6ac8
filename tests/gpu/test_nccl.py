"""NCCL on one rank (a fresh process): the collectives Megatron and the plugin use, then a short
mea-pretrain run in bf16 with the distributed optimizer, an MoE layer, MEA virtual heads on the
`weights` exchange (fold cache), NVML telemetry in every step's record and a dist-checkpoint."""

import math

import pytest

from tests._dist import run_distributed


def _nccl_worker(rank, world_size, save_dir):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    x = torch.arange(8.0, device=device)
    dist.all_reduce(x)
    gathered = torch.empty(8 * world_size, device=device)
    dist.all_gather_into_tensor(gathered, x)
    scattered = torch.empty(8 // world_size, device=device)
    dist.reduce_scatter_tensor(scattered, gathered[:8])
    swapped = torch.empty(8, device=device)
    dist.all_to_all_single(swapped, x)
    collectives_ok = bool(torch.equal(gathered[:8], x) and torch.equal(swapped, x))

    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import pretrain

    argv = [
        "--mock-data", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
        "--num-query-groups", "4", "--seq-length", "256", "--num-experts", "4",
        "--moe-ffn-hidden-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "8", "--lr", "1e-3", "--bf16", "--use-distributed-optimizer",
        "--attention-variant", "mea", "--mea-num-kv-components", "2",
        "--mea-tp-exchange", "weights", "--eval-interval", "8", "--eval-iters", "1",
        "--log-interval", "4", "--no-progress-bar", "--save", save_dir,
        "--data-cache-path", save_dir + "_cache",
    ]
    history = pretrain(*parse_run(argv))
    return {"collectives_ok": collectives_ok, "backend": dist.get_backend(),
            "history": history}


@pytest.mark.gpu
def test_nccl_group_and_a_bf16_distributed_optimizer_run(tmp_path):
    (result,) = run_distributed(_nccl_worker, 1, str(tmp_path / "ckpt"))
    assert result["backend"] == "nccl"
    assert result["collectives_ok"]
    history = result["history"]
    assert len(history) == 8
    assert all(math.isfinite(r["lm loss"]) and not r["skipped"] for r in history)
    assert math.isfinite(history[-1]["valid loss"])
    # NVML telemetry lands in every step's record (and so in the log lines).
    assert all(r.get("gpu_mem_gib", 0) > 0 and "gpu_power_w" in r for r in history)
    assert any(p.name.startswith("iter_") for p in (tmp_path / "ckpt").iterdir())
