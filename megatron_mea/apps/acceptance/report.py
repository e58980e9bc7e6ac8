"""Checks and rates of an acceptance run from its raw records, and its text summary."""

import math
import os
import statistics
import xml.etree.ElementTree as ElementTree
from typing import List, Optional


def train_flops_per_token(shape: dict) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward) of the baseline GPT:
    the dense matmuls plus causal attention counted as half of the square, as a causal kernel
    computes it, plus the output layer. Used for every variant, so their MFU compares as
    throughput (the plugin's own FLOPs are well under 1% at these shapes)."""
    h, s = shape["hidden_size"], shape["seq_length"]
    heads, groups = shape["num_attention_heads"], shape["num_query_groups"]
    hn = shape.get("kv_channels") or h // heads
    ffn = shape.get("ffn_hidden_size") or 4 * h
    qkv = 2 * h * (heads + 2 * groups) * hn
    attention = 2 * 2 * s * heads * hn / 2
    proj = 2 * heads * hn * h
    mlp = 2 * h * ffn * (3 if shape.get("swiglu", True) else 2)
    logits = 2 * h * shape["vocab_size"]
    return 3 * (shape["num_layers"] * (qkv + attention + proj + mlp) + logits)


def loss_falls(losses: List[float], window: int = 5) -> dict:
    """First and last `window`-step mean losses and whether the loss fell by at least 5%."""
    window = max(1, min(window, len(losses) // 2))
    first = statistics.fmean(losses[:window])
    last = statistics.fmean(losses[-window:])
    return {"loss_first": first, "loss_last": last, "falling": last < 0.95 * first}


def summarize_run(raw: Optional[dict], peak_tflops: Optional[float]) -> dict:
    """One training run's checks and rates from the worker's raw record."""
    if raw is None:
        return {"ok": False, "error": "no result (the worker stopped before this run)"}
    if "error" in raw:
        return {"ok": False, "error": raw["error"]}
    losses, seconds = raw["losses"], raw["step_seconds"]
    if len(losses) < 4:
        return {"ok": False, "error": f"only {len(losses)} steps ran", "losses": losses}
    finite = all(math.isfinite(loss) for loss in losses)
    row = {"steps": len(losses), "iters_planned": raw["iters_planned"], "build_s": raw["build_s"],
           "all_finite": finite, "skipped_steps": raw["skipped_steps"], **loss_falls(losses)}
    # Steady state: the first 10% of the steps (at least 2) warm up kernels and allocators.
    steady = seconds[max(2, len(seconds) // 10):] or seconds
    step_s = statistics.median(steady)
    row["step_s"] = step_s
    row["tokens_per_s"] = raw["tokens_per_step"] / step_s
    flops = train_flops_per_token(raw["shape"]) * row["tokens_per_s"]
    row["model_tflops_per_s"] = flops / 1e12
    row["mfu"] = flops / 1e12 / peak_tflops if peak_tflops else None
    for key in ("peak_memory_gib", "peak_reserved_gib", "nvml_last", "transformer_impl",
                "core_attention", "bf16"):
        if key in raw:
            row[key] = raw[key]
    row["losses_every_10"] = losses[::10]
    row["ok"] = finite and row["falling"] and raw["skipped_steps"] == 0
    return row


def summarize_bench(bench: dict) -> dict:
    """Per core attention and variant: layer median ms, ratio to its baseline, TFLOP/s; the
    model-step ratio."""
    flops = bench["layer_flops"]
    out = {"shape": bench["shape"], "rounds": bench["rounds"], "core_attention": {}}
    for core, sections in bench["by_core_attention"].items():
        rows = {}
        for name, row in sections["layer"].items():
            rows[name] = {"layer_ms": row["median_s"] * 1e3, "layer_ratio": row.get("ratio"),
                          "layer_tflops": flops / row["median_s"] / 1e12}
            step = sections.get("model_step", {}).get(name)
            if step:
                rows[name].update(model_step_ms=step["median_s"] * 1e3,
                                  model_step_ratio=step.get("ratio"))
        out["core_attention"][core] = rows
    return out


def junit_counts(path: str) -> dict:
    """Counts of a pytest JUnit XML report, and the tests that did not pass."""
    if not os.path.exists(path):
        return {}
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    not_passed = []
    for suite in suites:
        counts["tests"] += int(suite.get("tests", 0))
        counts["failed"] += int(suite.get("failures", 0))
        counts["errors"] += int(suite.get("errors", 0))
        counts["skipped"] += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            for outcome in ("failure", "error", "skipped"):
                element = case.find(outcome)
                if element is not None:
                    message = (element.get("message") or "").splitlines()
                    not_passed.append(f"{outcome}: {case.get('classname')}::{case.get('name')}"
                                      f" -- {message[0][:160] if message else ''}")
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    counts["not_passed"] = not_passed
    return counts


def status(row: dict) -> str:
    """`ok`, `SKIPPED` (not available on this machine: decides nothing) or `FAILED`."""
    if row.get("not_available"):
        return "SKIPPED"
    return "ok" if row.get("ok") else "FAILED"


def why(row: dict) -> str:
    """The reason a step failed or was skipped, for the log and the summary."""
    for key in ("not_available", "out_of_time", "error"):
        if row.get(key):
            return str(row[key])
    if row.get("timed_out"):
        return f"timed out (see {row.get('log')})"
    if row.get("returncode"):
        return f"exit status {row['returncode']} (see {row.get('log')})"
    return "a check failed (see acceptance.json)"


def failure(run: dict, ok: bool) -> dict:
    """What a step records of its subprocess: the log name always, the tail when it failed."""
    info = {"log": run["log"], "returncode": run["returncode"], "timed_out": run["timed_out"],
            "cpu_s": run["cpu_s"]}
    if not ok:
        info["tail"] = run["tail"]
    return info


def summary(result: dict) -> str:
    """The short text report of `acceptance.json`'s contents."""
    env = result.get("environment", {})
    lines = [f"MEA/KHA GPU acceptance ({result['mode']}): "
             f"{'PASSED' if result.get('ok') else 'FAILED'} in {result.get('seconds', 0):.0f} s "
             f"({result.get('cpu_seconds', 0):.0f} CPU-seconds)"]
    lines.append(f"  {env.get('gpu', 'no GPU')}, driver {env.get('driver')}, torch "
                 f"{env.get('torch')} (CUDA {env.get('torch_cuda')}), TE "
                 f"{env.get('transformer_engine')}, megatron-core {env.get('megatron_core')}")
    for name, row in result["steps"].items():
        lines.append(f"\n[{status(row)}] {name} ({row.get('seconds', 0):.0f} s, "
                     f"{row.get('cpu_seconds', 0):.0f} CPU-s)"
                     + ("" if row.get("ok") else f": {why(row)}"))
        if name == "gpu_tests" and "tests" in row:
            lines.append(f"  {row.get('passed', 0)} passed, {row.get('failed', 0)} failed, "
                         f"{row.get('errors', 0)} errors, {row.get('skipped', 0)} skipped")
            lines.extend(f"    {test}" for test in row.get("not_passed", [])[:20])
        if name == "training" and "runs" in row:
            lines.extend(_training_lines(row))
        if name == "layer_bench" and "shapes" in row:
            lines.extend(_bench_lines(row))
        if name == "decode_bench" and "rows" in row:
            lines.extend(_decode_lines(row))
        if name == "paged_kernel" and "exact" in row:
            lines.extend(_paged_kernel_lines(row))
        if name == "megatron_lm" and "runs" in row:
            lines.extend(f"  {run:<14} {r}" for run, r in row["runs"].items())
    if result.get("skipped"):
        lines.append("\nskipped: " + "; ".join(f"{name} ({reason})"
                                              for name, reason in result["skipped"].items()))
    return "\n".join(lines)


def summarize_decode(bench: dict) -> dict:
    """`mea-bench-decode --json`'s table: per context length and variant, KV-cache bytes and
    decode tokens/s, each against the baseline of the same run."""
    rows = {}
    for row in bench["results"]:
        rows.setdefault(str(row["context"]), {})[row["variant"]] = {
            "kv_bytes": row["kv_bytes"], "kv_bytes_vs_base": row["kv_bytes_vs_base"],
            "decode_tokens_per_s": row["decode_tokens_per_second"],
            "speed_vs_base": row["speed_vs_base"]}
    return {"setup": bench["setup"], "rows": rows}


def _decode_lines(row: dict) -> List[str]:
    setup = row["setup"]
    lines = [f"  {setup['layers']} layers, hidden {setup['hidden']}, heads "
             f"{setup['heads']}/{setup['groups']}, batch {setup['batch']}, {setup['dtype']}",
             f"  {'context':>8} {'variant':>9} {'KV bytes':>8} {'tok/s':>10} {'vs base':>8}"]
    for context, variants in row["rows"].items():
        for variant, r in variants.items():
            lines.append(f"  {context:>8} {variant:>9} {r['kv_bytes_vs_base']:>7.3f}x "
                         f"{r['decode_tokens_per_s']:>10.1f} {r['speed_vs_base']:>7.3f}x")
    return lines


def summarize_paged_kernel(result: dict) -> dict:
    """`acceptance/paged_kernel.py`'s record: per dtype and form the largest kernel and torch
    errors from the fp64 truth; the timings as they are."""
    exact = {}
    for dtype, forms in result["exact"].items():
        exact[dtype] = {form: {"kernel_error": max(row["kernel_error"].values()),
                               "torch_error": max(row["torch_error"].values()), "ok": row["ok"]}
                        for form, row in forms.items() if isinstance(row, dict) and "ok" in row}
    return {"device": result["device"], "shape": result["shape"], "exact": exact,
            "timing": result["timing"], "decode": result["decode"], "prefill": result["prefill"]}


def _paged_kernel_lines(row: dict) -> List[str]:
    s = row["shape"]
    lines = [f"  {row['device']}: {s['heads']} query heads, {s['groups']} K/V groups, "
             f"{s['components']} components of {s['head_dim']}, blocks of {s['block']}"
             + (" (Triton's interpreter: the timings mean nothing)"
                if row["device"] == "cpu" else "")]
    for dtype, forms in row["exact"].items():
        for form, r in forms.items():
            lines.append(f"  exact {dtype:<9} {form:<9} kernel {r['kernel_error']:.2e}, torch "
                         f"{r['torch_error']:.2e} from fp64{'' if r['ok'] else '  <- too far'}")
    timing = row["timing"]
    lines.append(f"  {timing['dtype']}, ms: MEA kernel / original (same kernel) / original SDPA"
                 f"; MEA over each")
    for kind, batch in (("decode", timing["decode_batch"]), ("prefill", timing["prefill_batch"])):
        for context, r in row[kind].items():
            lines.append(f"  {kind} {batch} x {context:>5}: {r['mea_kernel_ms']:.3f} / "
                         f"{r['original_kernel_ms']:.3f} / {r['original_sdpa_ms']:.3f} ms; "
                         f"{r['vs_original_kernel']:.2f}x, {r['vs_original_sdpa']:.2f}x "
                         f"({r['sdpa']})")
    return lines


def _training_lines(row: dict) -> List[str]:
    lines = ["  " + "; ".join(row.get("setup", [])),
             f"  {'run':<12}{'steps':>6}{'loss first':>11}{'last':>8}{'tok/s':>10}"
             f"{'vs base':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>9}"]
    for run, r in row["runs"].items():
        if "tokens_per_s" not in r:
            lines.append(f"  {run:<12} {r.get('error', 'no result')}")
            continue
        mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        lines.append(
            f"  {run:<12}{r['steps']:>6}{r['loss_first']:>11.3f}{r['loss_last']:>8.3f}"
            f"{r['tokens_per_s']:>10.0f}{r.get('step_time_ratio', float('nan')):>8.3f}x"
            f"{r['model_tflops_per_s']:>9.3g}{mfu:>7}{peak:>9}"
            + ("" if r["ok"] else "  <- not finite / not falling / skipped steps"))
    return lines


def _bench_lines(row: dict) -> List[str]:
    lines = []
    for key, shape in row["shapes"].items():
        if "core_attention" not in shape:
            lines.append(f"  {key}: {shape}")
            continue
        s = shape["shape"]
        lines.append(f"  {key}: hidden {s['hidden_size']}, heads "
                     f"{s['num_attention_heads']}/{s['num_query_groups']}, seq "
                     f"{s['seq_length']}, {s['dtype']}")
        for core, rows in shape["core_attention"].items():
            base = rows.get("baseline", {})
            lines.append(f"    core attention {core}: baseline "
                         f"{base.get('layer_ms', 0):.2f} ms/layer, "
                         f"{base.get('layer_tflops', 0):.3g} TFLOP/s")
            for variant, r in rows.items():
                if variant == "baseline":
                    continue
                model = (f", model step {r['model_step_ratio']:.3f}x"
                         if r.get("model_step_ratio") else "")
                lines.append(f"      {variant:<18} layer {r['layer_ratio']:.3f}x"
                             f" ({r['layer_tflops']:.3g} TFLOP/s){model}")
    return lines
