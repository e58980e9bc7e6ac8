"""`mea-bench-attention`: the cost of MEA and KHA against the baseline, per layer and model step.

1. Time: forward + backward of one transformer layer, and one step of a small full GPT (micro-
   batches, fold flush, Adam), for every variant in one process. Rounds run the variants in a
   shuffled order; the ratio to the baseline is the median over rounds of the paired ratio
   (same round, so the machine's drift cancels). Not a test: numbers depend on the machine.
   The local spec is timed with each `--core-attention` (default both: Megatron's unfused
   `DotProductAttention`, whose score tensors dominate a CPU step, and torch's fused
   `scaled_dot_product_attention`), each against its own baseline; the JSON has them under
   `by_core_attention`, and `layer` / `model_step` repeat the first.
2. Bytes: every collective of one layer's forward + backward at TP=2 and TP=4 (sequence parallel,
   real gloo processes), counted by wrapping `torch.distributed`
   (`megatron_mea.parallel.comm_counter`), and the extra over the baseline checked against the
   formulas of `megatron_mea.parallel.exchange`; exit status 1 if they differ.

    mea-bench-attention                  # CPU: hidden 1024, 16/4 heads, seq 2048
    mea-bench-attention --device cuda --bf16 --hidden-size 4096 \\
        --num-attention-heads 32 --num-query-groups 8 --seq-length 4096   # one GPU

Prints a table; `--json` writes every number. `--profile` prints torch.profiler's top ops for
one layer step of each variant.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

from megatron_mea._optional import import_extra
from megatron_mea.apps.bench.collectives import count_bytes
from megatron_mea.apps.bench.steps import SHAPE, VARIANTS, LayerStep, ModelStep, layer_flops
from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.process_groups import free_port


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags: the shape, the rounds, the device, the TP sizes counted."""
    parser = ArgumentParser(prog="mea-bench-attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="baseline is always included (ratios are to it)")
    for name, default in SHAPE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help="default 4 * hidden" if default is None else None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds of every variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--model-layers", type=int, default=2,
                        help="layers of the full-model step (0 skips it)")
    parser.add_argument("--model-micro-batches", type=int, default=2)
    parser.add_argument("--model-repeats", type=int, default=7,
                        help="timed rounds of the model step")
    parser.add_argument("--tp-sizes", type=int, nargs="*", default=[2, 4],
                        help="TP sizes whose collectives are counted (none: skip)")
    parser.add_argument("--bytes-seq-length", type=int, default=None,
                        help="sequence length of the byte count (default --seq-length)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 params and activations")
    parser.add_argument("--transformer-engine", action="store_true",
                        help="TE spec (TEDotProductAttention etc.); needs megatron_mea[te]")
    parser.add_argument("--core-attention", nargs="+", default=["megatron", "sdpa"],
                        choices=["megatron", "sdpa"],
                        help="core attention(s) of the local spec, each timed against its own "
                             "baseline: megatron (unfused DotProductAttention), sdpa (torch's "
                             "scaled_dot_product_attention); the TE spec always uses TE's")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None, help="write all results to this file")
    parser.add_argument("--seed", type=int, default=1234)
    return parser


# ---- timing -------------------------------------------------------------------------------------


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(steps: dict, args, repeats: int, cpu_times: dict = None) -> dict:
    """Seconds of every round per variant; the variants' order is shuffled every round.

    `cpu_times`, if given, receives this process's CPU seconds per round and variant (on a
    loaded CPU machine, time spent descheduled counts in wall time but not here)."""
    tqdm = import_extra("tqdm", "the benchmark's progress bar").tqdm
    order = list(steps)
    rng = random.Random(args.seed)
    times = {name: [] for name in steps}
    for round_index in tqdm(range(args.warmup + repeats), desc="rounds", leave=False):
        rng.shuffle(order)
        for name in order:
            _sync(args.device)
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            _sync(args.device)
            if round_index >= args.warmup:
                times[name].append(time.perf_counter() - start)
                if cpu_times is not None:
                    cpu_times.setdefault(name, []).append(time.process_time() - start_cpu)
    return times


def ratios(times: dict, cpu_times: dict = None) -> dict:
    """Median seconds and the median over rounds of the paired ratio to the baseline (and the
    same of CPU seconds, `cpu_median_s` / `cpu_ratio`, when `cpu_times` is given)."""
    base = times.get("baseline")
    result = {}
    for name, seconds in times.items():
        row = {"median_s": statistics.median(seconds)}
        if base is not None:
            row["ratio"] = statistics.median(t / b for t, b in zip(seconds, base))
        if cpu_times:
            row["cpu_median_s"] = statistics.median(cpu_times[name])
            if base is not None:
                row["cpu_ratio"] = statistics.median(
                    t / b for t, b in zip(cpu_times[name], cpu_times["baseline"]))
        result[name] = row
    return result


def profile(steps: dict, args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    for name, step in steps.items():
        with torch_profile(activities=activities) as prof:
            step()
        core = type(step.layer.self_attention.core_attention).__name__
        print(f"\n--- profile: {name}, {core} (one layer forward + backward) ---")
        print(prof.key_averages().table(sort_by=sort, row_limit=15))


# ---- report -------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


CORE_ATTENTION_NAMES = {"megatron": "megatron (unfused DotProductAttention)",
                        "sdpa": "sdpa (torch scaled_dot_product_attention)",
                        "te": "te (TEDotProductAttention)"}


def report(result: dict) -> str:
    lines = []
    shape = result["shape"]
    lines.append(
        f"shape: hidden {shape['hidden_size']}, heads {shape['num_attention_heads']}/"
        f"{shape['num_query_groups']}, seq {shape['seq_length']}, micro-batch "
        f"{shape['micro_batch_size']}, {shape['dtype']}, {shape['device']}; rounds: "
        f"{result['rounds']['layer']} per layer, {result['rounds']['model_step']} per model step"
    )
    sections = [(core, key, rows.get(key)) for core, rows in result["by_core_attention"].items()
                for key in ("layer", "model_step")]
    titles = {"layer": "one layer, forward + backward",
              "model_step": "small GPT step (micro-batches + Adam)"}
    for core, key, rows in sections:
        if not rows:
            continue
        lines.append(f"\n{titles[key]}; core attention: {CORE_ATTENTION_NAMES[core]}")
        header = f"{'variant':<18}{'median ms':>11}{'vs baseline':>13}"
        if key == "layer":
            header += f"{'TFLOP/s':>9}"
        with_cpu = "cpu_ratio" in next(iter(rows.values()))
        if with_cpu:
            header += f"{'CPU-time ratio':>16}"
        lines.append(header)
        for name, row in rows.items():
            ratio = row.get("ratio", float("nan"))
            line = f"{name:<18}{row['median_s'] * 1e3:>11.1f}{ratio:>12.3f}x"
            if key == "layer":
                line += f"{result['layer_flops'] / row['median_s'] / 1e12:>9.3f}"
            if with_cpu:
                line += f"{row.get('cpu_ratio', float('nan')):>15.3f}x"
            lines.append(line)
    for tp, rows in result.get("bytes", {}).items():
        lines.append(f"\ncollectives of one layer forward + backward, TP={tp} with SP "
                     "(MiB sent per rank, fp32)")
        lines.append(f"{'variant':<18}{'total':>9}{'extra':>9}{'formula':>9}  ok  calls by op")
        for name, row in rows.items():
            ops = ", ".join(f"{op} {v['calls']}x {_mib(v['sent_bytes'])}"
                            for op, v in sorted(row["ops"].items()))
            ok = "yes" if row.get("matches_formula") else "NO"
            lines.append(
                f"{name:<18}{_mib(row['sent_bytes']):>9}{_mib(row.get('extra_bytes', 0)):>9}"
                f"{_mib(row['expected_extra_bytes']):>9}  {ok:<3} {ops}"
            )
    return "\n".join(lines)


@megatron_on_cpu()
def main(argv=None) -> int:
    """Time the variants, count their collectives, print the table.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0, or 1 when a counted collective differs from its formula.
    """
    args = build_parser().parse_args(argv)
    import torch

    from megatron_mea._optional import require
    from megatron_mea.cpu import init_cpu_rng_tracker

    if args.transformer_engine:
        require("transformer_engine", "--transformer-engine")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "baseline" not in args.variants:
        args.variants = ["baseline", *args.variants]

    # Megatron needs a process group and parallel state even at TP=1.
    import torch.distributed as dist
    from megatron.core import parallel_state

    # Always a world of one on a fresh port (an inherited MASTER_PORT may be in use).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    init_cpu_rng_tracker(args.seed)

    result = {
        "shape": {k: getattr(args, k) for k in ("hidden_size", "num_attention_heads",
                                               "num_query_groups", "seq_length",
                                               "micro_batch_size", "device")}
        | {"dtype": "bf16" if args.bf16 else "fp32"},
        "rounds": {"layer": args.repeats, "model_step": args.model_repeats},
        "layer_flops": layer_flops(args),
    }
    # Each core attention is timed in its own interleaved rounds, against its own baseline.
    # "layer" / "model_step" repeat the first one's rows (the TE spec: "te", TE's attention).
    cores = ["megatron"] if args.transformer_engine else list(dict.fromkeys(args.core_attention))
    result["by_core_attention"] = {}
    for core in cores:
        label = "te" if args.transformer_engine else core
        rows = result["by_core_attention"][label] = {}
        layer_steps = {name: LayerStep(args, name, core_attention=core) for name in args.variants}
        if args.profile:
            profile(layer_steps, args)
        print(f"[bench] timing one layer ({label} core attention): {len(layer_steps)} variants x "
              f"{args.repeats} rounds (+{args.warmup} warm-up)", flush=True)
        cpu = {} if args.device == "cpu" else None
        rows["layer"] = ratios(time_interleaved(layer_steps, args, args.repeats, cpu), cpu)
        del layer_steps
        if args.model_layers:
            print(f"[bench] timing a {args.model_layers}-layer GPT step ({label})", flush=True)
            model_steps = {name: ModelStep(args, name, core) for name in args.variants}
            cpu = {} if args.device == "cpu" else None
            rows["model_step"] = ratios(
                time_interleaved(model_steps, args, args.model_repeats, cpu), cpu)
            del model_steps
    first = next(iter(result["by_core_attention"].values()))
    result.update(layer=first["layer"], model_step=first.get("model_step", {}))
    dist.destroy_process_group()
    parallel_state.destroy_model_parallel()

    result["bytes"] = {}
    for tp in args.tp_sizes:
        print(f"[bench] counting collectives at TP={tp}", flush=True)
        result["bytes"][tp] = count_bytes(args, tp)

    print("\n" + report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
        print(f"\n[bench] wrote {args.json}")
    mismatched = [f"TP={tp} {name}" for tp, rows in result["bytes"].items()
                  for name, row in rows.items() if not row.get("matches_formula")]
    if mismatched:
        print(f"[bench] collective bytes differ from the formulas: {mismatched}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
