"""`mea-gpu-acceptance`: everything that needs a GPU, checked in one run of under 8 minutes.

On a machine with one CUDA GPU (bootstrap with `scripts/gpu_acceptance.sh`, see docs/gpu.md):

1. environment: GPU, driver, CUDA, torch, NCCL, Transformer Engine (if importable),
   megatron-core, megatron_mea;
2. the GPU test tier, `pytest -m gpu tests/gpu` (bf16 layers against fp32, the TE spec, FP8,
   NCCL with the distributed optimizer, NVML telemetry);
3. training: baseline, MEA with virtual heads and KHA, a few hundred bf16 steps each on mock data
   through mea-pretrain's own argument parser and `Trainer`; checks that every loss is finite and
   that the loss falls; reports tokens/s, peak memory and MFU;
4. the layer benchmark (`mea-bench-attention`) in bf16 at hidden 2048 (16/4 heads) and 4096
   (32/8), sequence 4096: step-time ratios to the baseline and TFLOP/s, with the SDPA and the
   unfused core attention of the local spec, and with the TE spec when TE imports.

Writes `acceptance.json` (every number) and `summary.txt` under `--out` (default `$OUT`, else
`runs/gpu_acceptance`), with the logs of every step. Exit status 0 when every step passed, 1 when
one failed, 2 without a CUDA device (unless `--cpu-smoke`).

`--cpu-smoke` runs the same steps at tiny sizes on the CPU (fp32; the GPU tests are collected and
skipped), so that the script keeps working without a GPU; `tests/test_gpu_acceptance.py` runs it.

    bash scripts/gpu_acceptance.sh                 # GPU machine: install wheels/, then this
    python -m megatron_mea.cli.gpu_acceptance --cpu-smoke --out /tmp/smoke

This module imports only the standard library at load time: the bootstrap calls
`--missing-wheels` before megatron-core is installed.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import List, Optional

# Dense bf16 peak of the GPUs this is likely to meet, in TFLOP/s (NVIDIA data sheets, SXM parts
# unless named); the first name contained in torch's device name wins. `--peak-tflops` overrides.
PEAK_BF16_TFLOPS = (
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
)

# Always installed from wheels/ when present there (the versions the plugin was tested with);
# other wheels only when their distribution is missing, so the machine's own builds are kept.
ALWAYS_INSTALL = ("megatron-core", "megatron-mea")


@dataclasses.dataclass
class Plan:
    """Sizes and time limits of one acceptance run (`GPU_PLAN` or `SMOKE_PLAN`)."""

    mode: str
    test_timeout_s: int
    # training (mea-pretrain flags), shared by the three runs
    train_flags: List[str]
    train_seconds: float  # per run, after the model is built; the run stops at iters or here
    warmup_seconds: float  # an unreported baseline run first (one-time costs of the process)
    train_timeout_s: int  # the whole training worker
    # layer benchmark: (hidden, heads, groups) per shape, and mea-bench-attention's other flags
    bench_shapes: List[tuple]
    bench_flags: List[str]
    bench_timeout_s: int  # per benchmark process
    budget_s: int  # the whole run; a step that no longer fits is skipped


GPU_PLAN = Plan(
    mode="gpu",
    test_timeout_s=240,
    train_flags=[
        "--num-layers", "12", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--num-query-groups", "4", "--seq-length", "4096", "--num-experts", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "300",
        "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-fraction", "0.03", "--bf16",
    ],
    train_seconds=35.0,
    warmup_seconds=5.0,
    train_timeout_s=300,
    bench_shapes=[(2048, 16, 4), (4096, 32, 8)],
    bench_flags=[
        "--device", "cuda", "--bf16", "--seq-length", "4096", "--micro-batch-size", "1",
        "--repeats", "20", "--warmup", "3", "--model-layers", "2", "--model-micro-batches", "2",
        "--model-repeats", "8", "--vocab-size", "32768",
    ],
    bench_timeout_s=150,
    budget_s=465,
)

SMOKE_PLAN = Plan(
    mode="cpu-smoke",
    test_timeout_s=120,
    train_flags=[
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--num-experts", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "24",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-fraction", "0.05",
    ],
    # Generous: on an idle machine a run's 24 steps take about a second; the limits only matter
    # on a loaded one, where a run cut after a few steps could not show a falling loss.
    train_seconds=60.0,
    warmup_seconds=1.0,
    train_timeout_s=420,
    bench_shapes=[(64, 8, 2), (128, 8, 2)],
    bench_flags=[
        "--device", "cpu", "--seq-length", "64", "--micro-batch-size", "1", "--repeats", "2",
        "--warmup", "1", "--model-layers", "1", "--model-micro-batches", "1",
        "--model-repeats", "1", "--vocab-size", "128",
    ],
    bench_timeout_s=240,
    budget_s=850,
)

# The three training runs: name -> the variant's mea-pretrain flags. MEA with virtual heads
# rebuilds the 4 (smoke: 2) composite K/V heads from half as many components.
TRAIN_VARIANTS = {
    "baseline": ["--attention-variant", "standard"],
    "mea-virtual": ["--attention-variant", "mea", "--mea-num-kv-components", "HALF_GROUPS"],
    "kha": ["--attention-variant", "kha"],
}


def repo_root() -> str:
    """The checkout that holds this package (tests/gpu is run from there)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _log(message: str) -> None:
    print(f"[acceptance] {message}", flush=True)


# ---- wheels (the bootstrap, before anything but the standard library is importable) ----------


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def missing_wheels(directory: str) -> List[str]:
    """Distribution names of the wheels in `directory` that this interpreter should install:
    those of `ALWAYS_INSTALL`, and any other whose distribution is not installed. Names only:
    `pip --no-index --find-links` picks the wheel that fits this Python (wheels/ holds one per
    Python version for compiled packages, not always of the same release)."""
    from importlib import metadata

    wanted = []
    for filename in sorted(os.listdir(directory)):
        if not filename.endswith(".whl"):
            continue
        name = _normalise(filename.split("-")[0])
        if name in wanted:
            continue
        if name not in ALWAYS_INSTALL:
            try:
                metadata.version(name)
                continue
            except metadata.PackageNotFoundError:
                pass
        wanted.append(name)
    return wanted


# ---- numbers ----------------------------------------------------------------------------------


def peak_bf16_tflops(device_name: Optional[str]) -> Optional[float]:
    """The dense bf16 peak of a GPU from its name, or None if unknown."""
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


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


# ---- the training worker (a subprocess: one clean process for the three runs) -----------------


def _train_worker(spec_path: str) -> int:
    """Run the training runs of `spec_path` (JSON: runs, seconds, out) one after the other."""
    from megatron_mea.cpu import megatron_on_cpu

    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    results = {}
    with megatron_on_cpu():
        for run in spec["runs"]:
            _log(f"training {run['name']}: {' '.join(run['argv'])}")
            try:
                results[run["name"]] = _train_one(run["argv"], run.get("seconds", spec["seconds"]))
            except Exception as exc:  # noqa: BLE001 -- report it, run the next variant
                import gc
                import traceback

                import torch

                traceback.print_exc()
                results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
                del exc
                gc.collect()  # the failed run's model and optimizer, before the next one
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            with open(spec["out"], "w", encoding="utf-8") as handle:
                json.dump(results, handle, indent=1)
    return 0


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _train_one(argv: List[str], seconds: float) -> dict:
    """mea-pretrain's argument parsing and `Trainer` (model, optimizer, schedule, data), stepped
    here so that each step is timed and the run stops after `seconds`."""
    import gc

    import torch
    from megatron.core import parallel_state

    from megatron_mea.training.arguments import parse_args
    from megatron_mea.training.loop import Trainer

    on_gpu = torch.cuda.is_available()
    args = parse_args(argv)
    steps, telemetry = [], {}
    try:
        built_at = time.perf_counter()
        trainer = Trainer(args)
        build_s = time.perf_counter() - built_at
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        deadline = time.perf_counter() + seconds
        while trainer.iteration < args.train_iters:
            start = time.perf_counter()
            scalars = trainer.train_step()  # ends with .item() calls: the step is complete
            if on_gpu:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            trainer.iteration += 1
            steps.append({"loss": scalars["lm loss"], "grad_norm": scalars["grad norm"],
                          "skipped": scalars["skipped"], "seconds": elapsed})
            if trainer.iteration == 1:
                telemetry = trainer.telemetry.read()
            if time.perf_counter() > deadline:
                break
        telemetry = trainer.telemetry.read() or telemetry
    finally:
        parallel_state.destroy_model_parallel()
    result = {
        "argv": argv,
        "build_s": build_s,
        "steps": len(steps),
        "iters_planned": args.train_iters,
        "tokens_per_step": args.global_batch_size * args.seq_length,
        "losses": [step["loss"] for step in steps],
        "step_seconds": [step["seconds"] for step in steps],
        "skipped_steps": sum(step["skipped"] for step in steps),
        "nvml_last": telemetry,
        "shape": {
            "num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "num_query_groups": args.num_query_groups or args.num_attention_heads,
            "kv_channels": args.kv_channels, "ffn_hidden_size": args.ffn_hidden_size,
            "seq_length": args.seq_length, "swiglu": args.swiglu,
            "vocab_size": args.padded_vocab_size,
        },
        "transformer_impl": args.transformer_impl,
        "core_attention": getattr(args, "core_attention", "megatron"),
        "bf16": args.bf16,
    }
    if on_gpu:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del trainer
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


# ---- the steps --------------------------------------------------------------------------------


class Runner:
    """The acceptance run: its plan, output folder, time budget and results."""

    def __init__(self, plan: Plan, out: str, peak_tflops: Optional[float]):
        self.plan = plan
        self.out = out
        self.peak_override = peak_tflops
        self.started = time.perf_counter()
        self.cpu_s = 0.0  # CPU seconds of the step subprocesses (see write)
        self.result = {
            "mode": plan.mode,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "steps": {},
        }

    def remaining(self) -> float:
        return self.plan.budget_s - (time.perf_counter() - self.started)

    def subprocess(self, argv: List[str], log_name: str, timeout: float) -> dict:
        """Run `argv` from the repository root, its output teed to `log_name` under out."""
        log_path = os.path.join(self.out, log_name)
        # Each step is a world of its own: an inherited rendezvous (MASTER_PORT of a caller that
        # is itself a distributed process, such as a test session) would already be taken.
        env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS}
        env["PYTHONUNBUFFERED"] = "1"
        root = repo_root()
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        start = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(argv) + "\n")
            log.flush()
            process = subprocess.Popen(argv, cwd=root, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
            try:
                returncode = process.wait(timeout=max(1.0, timeout))
                timed_out = False
            except subprocess.TimeoutExpired:
                process.kill()
                returncode = process.wait()
                timed_out = True
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        self.cpu_s += cpu_s
        with open(log_path, encoding="utf-8", errors="replace") as log:
            tail = log.read()[-4000:]
        return {"returncode": returncode, "timed_out": timed_out, "log": log_name,
                "seconds": time.perf_counter() - start, "cpu_s": cpu_s, "tail": tail}

    def step(self, name: str, function, minimum_s: float) -> dict:
        """Run one step if at least `minimum_s` of the budget is left; record its result."""
        if self.remaining() < minimum_s:
            row = {"ok": False, "skipped": f"out of time ({self.remaining():.0f} s left of "
                                            f"{self.plan.budget_s} s)"}
        else:
            _log(f"--- {name} ({self.remaining():.0f} s of the budget left)")
            start, start_cpu = time.perf_counter(), self._cpu()
            try:
                row = function()
            except Exception as exc:  # noqa: BLE001 -- a failed step must not hide the others
                import traceback

                row = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}
            row["seconds"] = time.perf_counter() - start
            row["cpu_seconds"] = self._cpu() - start_cpu
        self.result["steps"][name] = row
        _log(f"{name}: {'ok' if row.get('ok') else 'FAILED'} "
             f"({row.get('seconds', 0):.0f} s){'' if row.get('ok') else ': ' + _why(row)}")
        self.write()
        return row

    def _cpu(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        return self.cpu_s + own.ru_utime + own.ru_stime

    def write(self) -> None:
        self.result["seconds"] = time.perf_counter() - self.started
        # CPU seconds of this process and of every step's subprocess: on a loaded machine the
        # wall time says little, this says what an idle one would need (divided by its cores).
        self.result["cpu_seconds"] = self._cpu()
        with open(os.path.join(self.out, "acceptance.json"), "w", encoding="utf-8") as handle:
            json.dump(self.result, handle, indent=1, default=str)

    # -- 1. environment

    def environment(self) -> dict:
        import torch

        env = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
        }
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.update(
                gpu=torch.cuda.get_device_name(0),
                gpu_count=torch.cuda.device_count(),
                gpu_memory_gib=props.total_memory / 2**30,
                compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                fp8_capable=torch.cuda.get_device_capability(0) >= (8, 9),
                cudnn=torch.backends.cudnn.version(),
                nccl=_nccl_version(),
                flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                driver=_driver_version(),
            )
        env["peak_bf16_tflops"] = self.peak_override or peak_bf16_tflops(env.get("gpu"))
        env["transformer_engine"] = _module_version("transformer_engine")
        # Used only if its torch extension really imports (a broken install counts as absent).
        env["te_usable"] = torch.cuda.is_available() and not _module_version(
            "transformer_engine.pytorch").startswith("missing")
        env["megatron_core"] = _module_version("megatron.core")
        env["megatron_mea"] = _module_version("megatron_mea")
        for name in ("pynvml", "pytest", "numpy"):
            env[name] = _module_version(name)
        self.result["environment"] = env
        for key, value in env.items():
            _log(f"  {key}: {value}")
        problems = [name for name in ("megatron_core", "megatron_mea", "pytest")
                    if str(env[name]).startswith("missing")]
        if problems:
            return {"ok": False, "error": f"not importable: {problems}"}
        return {"ok": True}

    def te_usable(self) -> bool:
        return bool(self.result.get("environment", {}).get("te_usable"))

    # -- 2. the GPU test tier

    def gpu_tests(self) -> dict:
        report = os.path.join(self.out, "gpu_tests.xml")
        argv = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs",
                "-p", "no:cacheprovider", f"--junitxml={report}"]
        run = self.subprocess(argv, "gpu_tests.log", min(self.plan.test_timeout_s,
                                                          self.remaining() - 5))
        counts = _junit_counts(report)
        ok = run["returncode"] == 0 and counts.get("tests", 0) > 0
        if self.plan.mode == "gpu":
            ok = ok and counts.get("passed", 0) > 0
        return {"ok": ok, **counts, **_failure(run, ok)}

    # -- 3. training

    def training(self) -> dict:
        from megatron_mea.training.arguments import PretrainArgs

        flags = list(self.plan.train_flags)
        groups = int(flags[flags.index("--num-query-groups") + 1])
        extra, notes = [], []
        if self.te_usable():
            extra += ["--transformer-impl", "transformer_engine"]
            notes.append("TE spec (transformer_impl=transformer_engine)")
        elif "core_attention" in {f.name for f in dataclasses.fields(PretrainArgs)}:
            extra += ["--core-attention", "sdpa"]
            notes.append("local spec, SDPA core attention")
        else:
            notes.append("local spec, Megatron's unfused core attention (mea-pretrain has no "
                         "--core-attention flag yet)")
        cache = os.path.join(self.out, "data_cache")
        common = [*flags, *extra, "--mock-data", "--data-cache-path", cache, "--eval-iters", "0",
                  "--log-interval", "1000000", "--no-progress-bar", "--seed", "1234"]
        runs = []
        for name, variant in TRAIN_VARIANTS.items():
            variant = [str(max(1, groups // 2)) if v == "HALF_GROUPS" else v for v in variant]
            runs.append({"name": name, "argv": common + variant})
        # A short unreported run first: the process's one-time costs (CUDA context, cuBLAS
        # handles, allocator growth, lazy imports) would otherwise land on the first variant.
        runs.insert(0, {"name": "warm-up", "argv": runs[0]["argv"],
                        "seconds": self.plan.warmup_seconds})
        seconds = min(self.plan.train_seconds, max(5.0, (self.remaining() - 140) / 3 - 15))
        out = os.path.join(self.out, "training_raw.json")
        spec = os.path.join(self.out, "training_spec.json")
        with open(spec, "w", encoding="utf-8") as handle:
            json.dump({"runs": runs, "seconds": seconds, "out": out}, handle, indent=1)
        argv = [sys.executable, "-m", "megatron_mea.cli.gpu_acceptance", "--train-worker", spec]
        run = self.subprocess(argv, "training.log", min(self.plan.train_timeout_s,
                                                         self.remaining() - 5))
        raw = {}
        if os.path.exists(out):
            with open(out, encoding="utf-8") as handle:
                raw = json.load(handle)
        peak = self.result.get("environment", {}).get("peak_bf16_tflops")
        rows = {name: summarize_run(raw.get(name), peak) for name in TRAIN_VARIANTS}
        base = rows["baseline"].get("tokens_per_s")
        for row in rows.values():
            if base and row.get("tokens_per_s"):
                row["step_time_ratio"] = base / row["tokens_per_s"]
        ok = run["returncode"] == 0 and all(row.get("ok") for row in rows.values())
        return {"ok": ok, "setup": notes, "seconds_per_run": seconds, "runs": rows,
                **_failure(run, ok)}

    # -- 4. the layer benchmark

    def layer_bench(self) -> dict:
        specs = [("local", ["--core-attention", "megatron", "sdpa"])]
        if self.te_usable():
            specs.append(("te", ["--transformer-engine"]))
        rows, ok, failures = {}, True, {}
        for hidden, heads, groups in self.plan.bench_shapes:
            for spec_name, spec_flags in specs:
                key = f"h{hidden}-{spec_name}"
                if self.remaining() < 20:
                    rows[key] = {"skipped": "out of time"}
                    ok = False
                    continue
                path = os.path.join(self.out, f"bench_{key}.json")
                argv = [sys.executable, "-m", "megatron_mea.cli.bench_attention",
                        *self.plan.bench_flags, *spec_flags, "--hidden-size", str(hidden),
                        "--num-attention-heads", str(heads), "--num-query-groups", str(groups),
                        "--tp-sizes", "--json", path]
                run = self.subprocess(argv, f"bench_{key}.log",
                                      min(self.plan.bench_timeout_s, self.remaining() - 5))
                if run["returncode"] != 0 or not os.path.exists(path):
                    ok = False
                    failures[key] = _failure(run, False)
                    continue
                with open(path, encoding="utf-8") as handle:
                    rows[key] = summarize_bench(json.load(handle))
        return {"ok": ok and bool(rows), "shapes": rows, **({"failures": failures} if failures
                                                             else {})}

    # -- the report

    def finish(self) -> int:
        steps = self.result["steps"]
        self.result["ok"] = all(row.get("ok") for row in steps.values())
        self.write()
        text = summary(self.result)
        with open(os.path.join(self.out, "summary.txt"), "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        print("\n" + text, flush=True)
        _log(f"wrote {os.path.join(self.out, 'acceptance.json')} and summary.txt")
        return 0 if self.result["ok"] else 1


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


def summary(result: dict) -> str:
    """The short text report."""
    env = result.get("environment", {})
    lines = [f"MEA/KHA GPU acceptance ({result['mode']}): "
             f"{'PASSED' if result.get('ok') else 'FAILED'} in {result.get('seconds', 0):.0f} s "
             f"({result.get('cpu_seconds', 0):.0f} CPU-seconds)"]
    lines.append(f"  {env.get('gpu', 'no GPU')}, driver {env.get('driver')}, torch "
                 f"{env.get('torch')} (CUDA {env.get('torch_cuda')}), TE "
                 f"{env.get('transformer_engine')}, megatron-core {env.get('megatron_core')}")
    for name, row in result["steps"].items():
        status = "ok" if row.get("ok") else "FAILED"
        lines.append(f"\n[{status}] {name} ({row.get('seconds', 0):.0f} s, "
                     f"{row.get('cpu_seconds', 0):.0f} CPU-s)"
                     + ("" if row.get("ok") else f": {_why(row)}"))
        if name == "gpu_tests" and "tests" in row:
            lines.append(f"  {row.get('passed', 0)} passed, {row.get('failed', 0)} failed, "
                         f"{row.get('errors', 0)} errors, {row.get('skipped', 0)} skipped")
            for test in row.get("not_passed", [])[:20]:
                lines.append(f"    {test}")
        if name == "training" and "runs" in row:
            lines.append("  " + "; ".join(row.get("setup", [])))
            lines.append(f"  {'run':<12}{'steps':>6}{'loss first':>11}{'last':>8}{'tok/s':>10}"
                         f"{'vs base':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>9}")
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
        if name == "layer_bench" and "shapes" in row:
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
    return "\n".join(lines)


# ---- helpers ----------------------------------------------------------------------------------


def _why(row: dict) -> str:
    for key in ("skipped", "error"):
        if row.get(key):
            return str(row[key])
    if row.get("timed_out"):
        return f"timed out (see {row.get('log')})"
    if row.get("returncode"):
        return f"exit status {row['returncode']} (see {row.get('log')})"
    return "a check failed (see acceptance.json)"


def _failure(run: dict, ok: bool) -> dict:
    """What a step records of its subprocess: the log name always, the tail when it failed."""
    info = {"log": run["log"], "returncode": run["returncode"], "timed_out": run["timed_out"],
            "cpu_s": run["cpu_s"]}
    if not ok:
        info["tail"] = run["tail"]
    return info


def _module_version(name: str) -> str:
    try:
        module = __import__(name, fromlist=["_"])
    except Exception as exc:  # noqa: BLE001 -- TE raises all sorts when its CUDA libs mismatch
        return f"missing ({type(exc).__name__}: {str(exc)[:120]})"
    version = getattr(module, "__version__", None)
    if version is None and name == "megatron.core":
        from megatron.core import package_info

        version = package_info.__version__
    path = os.path.dirname(getattr(module, "__file__", "") or "")
    version = version or "installed"
    return f"{version} ({path})" if name in ("megatron_mea", "megatron.core") else str(version)


def _nccl_version() -> Optional[str]:
    import torch

    try:
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
    except Exception:  # noqa: BLE001 -- informational only
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver_version() -> Optional[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 -- fall back to nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _junit_counts(path: str) -> dict:
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


def build_parser() -> argparse.ArgumentParser:
    """The flags (the hidden ones are the bootstrap's and the training worker's)."""
    parser = argparse.ArgumentParser(prog="mea-gpu-acceptance",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="output folder (default: $OUT, else runs/gpu_acceptance)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every step at tiny sizes on the CPU (no GPU needed)")
    parser.add_argument("--skip", nargs="+", default=[],
                        choices=["gpu_tests", "training", "layer_bench"],
                        help="steps to leave out")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak for MFU (default: from its name)")
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="seconds of training per variant (default: 35 on a GPU)")
    parser.add_argument("--budget-s", type=int, default=None,
                        help="the whole run's time budget; steps that no longer fit are skipped "
                             "(default 465 on a GPU)")
    parser.add_argument("--missing-wheels", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--train-worker", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    """Run the acceptance steps and write the report.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0 when every step passed, 1 when one failed, 2 without a CUDA device
        and without `--cpu-smoke`.
    """
    args = build_parser().parse_args(argv)
    if args.missing_wheels:
        print("\n".join(missing_wheels(args.missing_wheels)))
        return 0
    if args.train_worker:
        return _train_worker(args.train_worker)

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("mea-gpu-acceptance: no CUDA device is visible; on a CPU use --cpu-smoke",
              file=sys.stderr)
        return 2
    plan = dataclasses.replace(SMOKE_PLAN if args.cpu_smoke else GPU_PLAN)
    if args.train_seconds is not None:
        plan.train_seconds = args.train_seconds
    if args.budget_s is not None:
        plan.budget_s = args.budget_s
    out = args.out or os.environ.get("OUT") or os.path.join("runs", "gpu_acceptance")
    os.makedirs(out, exist_ok=True)
    runner = Runner(plan, os.path.abspath(out), args.peak_tflops)
    _log(f"mode {plan.mode}, output {runner.out}, budget {plan.budget_s} s")
    runner.step("environment", runner.environment, 0)
    steps = [("gpu_tests", runner.gpu_tests, 30), ("training", runner.training, 60),
             ("layer_bench", runner.layer_bench, 30)]
    for name, function, minimum in steps:
        if name not in args.skip:
            runner.step(name, function, minimum)
    return runner.finish()


if __name__ == "__main__":
    sys.exit(main())
