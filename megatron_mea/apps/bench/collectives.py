"""Bytes of every collective of one layer at TP > 1, against `parallel/exchange.py`'s formulas.

Real processes (gloo, CPU, fp32: the byte counts do not depend on the device); each counts its
own calls with `megatron_mea.parallel.comm_counter.CollectiveCounter`.
"""

import argparse
import json
import os

from megatron_mea.apps.bench.steps import LayerStep
from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.process_groups import free_port, start_process_groups
from megatron_mea.runtime.quiet import quiet_warnings  # the workers are part of the CLI's run


def expected_extra_bytes(args, variant, layer, tp: int) -> int:
    """The exchange of MEA's K/V plus the SUM all-reduce of every TP-replicated
    plugin matrix (HLC's `A`, KHA's `T`); the head norm is sharded and sends nothing."""
    from megatron_mea.parallel import (
        ExchangeShape,
        activation_exchange_elements,
        weight_exchange_elements,
    )
    from megatron_mea.parallel.comm_counter import ring_all_reduce_bytes

    replicated = sum(
        ring_all_reduce_bytes(p.numel() * p.element_size(), tp)
        for n, p in layer.named_parameters()
        if "head_mix." in n or "knock." in n
    )
    if not variant.startswith("mea"):
        return replicated
    attention = layer.self_attention
    shape = ExchangeShape(
        num_heads=args.num_attention_heads, num_groups=args.num_query_groups,
        num_components=attention.num_components, head_dim=attention.hidden_size_per_attention_head,
        hidden_size=args.hidden_size, tp_size=tp,
    )
    element = attention.linear_qkv.weight.element_size()
    if variant == "mea-weights":
        return replicated + weight_exchange_elements(shape) * element
    tokens = (args.bytes_seq_length or args.seq_length) * args.micro_batch_size
    return replicated + activation_exchange_elements(shape, tokens) * element


@megatron_on_cpu()  # a spawned process: an entry point of its own
def count_bytes_worker(rank, world_size, port, args, out_dir):
    """One rank of the byte count: every variant's layer at TP=world_size with SP, fp32 on CPU."""
    import torch
    import torch.distributed as dist

    from megatron_mea.cpu import init_cpu_rng_tracker
    from megatron_mea.parallel.comm_counter import CollectiveCounter

    quiet_warnings()
    torch.set_num_threads(1)
    start_process_groups("gloo", rank=rank, world_size=world_size, port=port,
                         parallel_sizes={"tensor_model_parallel_size": world_size})
    init_cpu_rng_tracker(args.seed)
    args = argparse.Namespace(**{**vars(args), "device": "cpu", "bf16": False,
                                 "transformer_engine": False,
                                 "seq_length": args.bytes_seq_length or args.seq_length})
    results = {}
    for variant in args.variants:
        step = LayerStep(args, variant, tp=world_size)
        step()  # warm-up (first-call allocations, lazily built buffers)
        with CollectiveCounter() as counter:
            step()
        results[variant] = {
            "ops": counter.summary(),
            "sent_bytes": counter.sent_bytes,
            "expected_extra_bytes": expected_extra_bytes(args, variant, step.layer, world_size),
        }
    if rank == 0:
        with open(os.path.join(out_dir, "bytes.json"), "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()


def count_bytes(args, tp: int) -> dict:
    """Spawn `tp` ranks; per variant: bytes sent by op, total, extra over the baseline, the
    formula's extra and whether they match."""
    import tempfile

    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(count_bytes_worker, args=(tp, port, args, out_dir), nprocs=tp,
                           start_method="spawn")
        with open(os.path.join(out_dir, "bytes.json"), encoding="utf-8") as handle:
            results = json.load(handle)
    base = results.get("baseline", {}).get("sent_bytes")
    for row in results.values():
        if base is not None:
            row["extra_bytes"] = row["sent_bytes"] - base
            row["matches_formula"] = row["extra_bytes"] == row["expected_extra_bytes"]
    return results
