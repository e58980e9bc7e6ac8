"""`mea-bench-attention`'s measurements: the time of one layer and of one small GPT step per
variant, in interleaved rounds, and the bytes of every collective at TP > 1 (`collectives`).

`args` is the namespace of `megatron_mea.cli.bench_attention`'s parser. Progress lines are INFO
records of this module's logger (the tool shows them on stdout).
"""

import logging
import random
import statistics
import time

from megatron_mea._optional import import_extra
from megatron_mea.apps.bench.collectives import count_bytes
from megatron_mea.apps.bench.steps import LayerStep, ModelStep, layer_flops
from megatron_mea.runtime.process_groups import free_port, start_process_groups

logger = logging.getLogger(__name__)


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
    """torch.profiler's top ops of one step of each of `steps`, logged."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    for name, step in steps.items():
        with torch_profile(activities=activities) as prof:
            step()
        core = type(step.layer.self_attention.core_attention).__name__
        logger.info("\n--- profile: %s, %s (one layer forward + backward) ---\n%s", name, core,
                    prof.key_averages().table(sort_by=sort, row_limit=15))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


CORE_ATTENTION_NAMES = {"megatron": "megatron (unfused DotProductAttention)",
                        "sdpa": "sdpa (torch scaled_dot_product_attention)",
                        "te": "te (TEDotProductAttention)"}


def report(result: dict) -> str:
    """The table of `run`'s result: times and ratios per core attention, bytes per TP size."""
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


def run(args) -> dict:
    """Time every variant of `args.variants` (the baseline first) with each core attention,
    then count the collectives at each of `args.tp_sizes`; the result `report` tabulates (and
    `--json` writes).

    Starts a world of one process on a fresh port (an inherited MASTER_PORT may be in use) for
    the timing, and ends it before the byte count spawns its own ranks.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mea.cpu import init_cpu_rng_tracker

    # Megatron needs a process group and parallel state even at TP=1.
    start_process_groups("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                         port=free_port())
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
        logger.info("[bench] timing one layer (%s core attention): %d variants x %d rounds "
                    "(+%d warm-up)", label, len(layer_steps), args.repeats, args.warmup)
        cpu = {} if args.device == "cpu" else None
        rows["layer"] = ratios(time_interleaved(layer_steps, args, args.repeats, cpu), cpu)
        del layer_steps
        if args.model_layers:
            logger.info("[bench] timing a %d-layer GPT step (%s)", args.model_layers, label)
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
        logger.info("[bench] counting collectives at TP=%d", tp)
        result["bytes"][tp] = count_bytes(args, tp)
    return result


def mismatches(result: dict) -> list:
    """`TP=<tp> <variant>` of every counted collective total that differs from its formula."""
    return [f"TP={tp} {name}" for tp, rows in result["bytes"].items()
            for name, row in rows.items() if not row.get("matches_formula")]
