"""The acceptance steps: environment, the GPU test tier, training, the decode benchmark, the
serving kernel, Megatron-LM's own loop, the layer benchmark.

Every step but the first runs in subprocesses of its own, under the run's time budget, with its
output teed to a log under the output folder; `acceptance.json` is rewritten after each step.
"""

import datetime
import json
import logging
import os
import resource
import subprocess
import sys
import time
from typing import List, Optional

import megatron_mea
from megatron_mea.apps.acceptance.environment import describe_environment
from megatron_mea.apps.acceptance.plans import TRAIN_VARIANTS, Plan
from megatron_mea.apps.acceptance.report import (
    failure,
    status,
    junit_counts,
    summarize_bench,
    summarize_decode,
    summarize_paged_kernel,
    summarize_run,
    summary,
    why,
)
from megatron_mea.runtime.files import atomic_write

logger = logging.getLogger(__name__)

# Rendezvous variables a step must not inherit (see Runner.subprocess).
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def repo_root() -> str:
    """The checkout that holds this package (tests/gpu is run from there)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(megatron_mea.__file__)))


class Runner:
    """The acceptance run: its plan, output folder, time budget and results.

    Args:
        plan: sizes and time limits (`GPU_PLAN` or `SMOKE_PLAN`).
        out: the report folder (exists): every log and record of the run.
        peak_tflops: the GPU's dense bf16 peak for MFU; None: from its name.
        scratch: a folder for what is not part of the report (the mock-data cache).
    """

    def __init__(self, plan: Plan, out: str, peak_tflops: Optional[float], scratch: str):
        self.plan = plan
        self.out = out
        self.scratch = scratch
        self.peak_override = peak_tflops
        self.started = time.perf_counter()
        self.cpu_s = 0.0  # CPU seconds of the step subprocesses (see write)
        self.result = {
            "mode": plan.mode,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "steps": {},
        }

    def remaining(self) -> float:
        """Seconds left of the run's budget."""
        return self.plan.budget_s - (time.perf_counter() - self.started)

    def subprocess(self, argv: List[str], log_name: str, timeout: float,
                   extra_env: Optional[dict] = None) -> dict:
        """Run `argv` from the repository root, its output teed to `log_name` under out, with
        `extra_env` added to the environment."""
        log_path = os.path.join(self.out, log_name)
        # Each step is a world of its own: an inherited rendezvous (MASTER_PORT of a caller that
        # is itself a distributed process, such as a test session) would already be taken.
        env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
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
            row = {"ok": False, "out_of_time": f"out of time ({self.remaining():.0f} s left of "
                                            f"{self.plan.budget_s} s, {minimum_s} s needed)"}
        else:
            logger.info("--- %s (%.0f s of the budget left)", name, self.remaining())
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
        logger.info("%s: %s (%.0f s)%s", name, status(row), row.get("seconds", 0),
                    "" if row.get("ok") else ": " + why(row))
        self.write()
        return row

    def _cpu(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        return self.cpu_s + own.ru_utime + own.ru_stime

    def write(self) -> None:
        """Rewrite `acceptance.json` with everything so far."""
        self.result["seconds"] = time.perf_counter() - self.started
        # CPU seconds of this process and of every step's subprocess: on a loaded machine the
        # wall time says little, this says what an idle one would need (divided by its cores).
        self.result["cpu_seconds"] = self._cpu()
        # All or nothing: the run may be stopped at its time limit while writing.
        with atomic_write(os.path.join(self.out, "acceptance.json")) as handle:
            json.dump(self.result, handle, indent=1, default=str)

    def environment(self) -> dict:
        """Step 1: what the machine has; fails if megatron-core, megatron_mea or pytest is
        missing."""
        env = describe_environment(self.peak_override)
        self.result["environment"] = env
        for key, value in env.items():
            logger.info("  %s: %s", key, value)
        problems = [name for name in ("megatron_core", "megatron_mea", "pytest")
                    if str(env[name]).startswith("missing")]
        if problems:
            return {"ok": False, "error": f"not importable: {problems}"}
        return {"ok": True}

    def te_usable(self) -> bool:
        """Whether step 1 found a Transformer Engine whose torch extension imports."""
        return bool(self.result.get("environment", {}).get("te_usable"))

    def gpu_tests(self) -> dict:
        """Step 2: `pytest -m gpu tests/gpu`; on a GPU at least one test must pass."""
        report = os.path.join(self.out, "gpu_tests.xml")
        argv = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs",
                "-p", "no:cacheprovider", f"--junitxml={report}"]
        run = self.subprocess(argv, "gpu_tests.log", min(self.plan.test_timeout_s,
                                                          self.remaining() - 5))
        counts = junit_counts(report)
        ok = run["returncode"] == 0 and counts.get("tests", 0) > 0
        if self.plan.mode == "gpu":
            ok = ok and counts.get("passed", 0) > 0
        return {"ok": ok, **counts, **failure(run, ok)}

    def training(self) -> dict:
        """Step 3: the runs of `TRAIN_VARIANTS` in one worker process (after an unreported
        warm-up run); each must have finite, falling losses and no skipped step."""
        runs, notes = self._training_runs()
        # What the later steps need (decode ~45 s, the serving kernel ~45 s, Megatron-LM ~60 s,
        # layer bench ~90 s on a GPU) stays in the budget; the three runs share the rest.
        seconds = min(self.plan.train_seconds, max(5.0, (self.remaining() - 245) / 3 - 15))
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
                **failure(run, ok)}

    def _training_runs(self):
        """([{name, argv, seconds?}] with the warm-up first, notes on the spec used)."""
        flags = list(self.plan.train_flags)
        groups = int(flags[flags.index("--num-query-groups") + 1])
        extra, notes = [], []
        if self.te_usable():
            extra += ["--transformer-impl", "transformer_engine"]
            notes.append("TE spec (transformer_impl=transformer_engine)")
        else:
            extra += ["--core-attention", "sdpa"]
            notes.append("local spec, SDPA core attention")
        cache = os.path.join(self.scratch, "data_cache")
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
        return runs, notes

    def layer_bench(self) -> dict:
        """Step 4: `mea-bench-attention` at each shape of the plan, with the local spec's core
        attentions and, where TE imports, the TE spec."""
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
                    failures[key] = failure(run, False)
                    continue
                with open(path, encoding="utf-8") as handle:
                    rows[key] = summarize_bench(json.load(handle))
        return {"ok": ok and bool(rows), "shapes": rows,
                **({"failures": failures} if failures else {})}

    def decode_bench(self) -> dict:
        """Step: `mea-bench-decode` (greedy decoding from the static KV cache) at the plan's
        context lengths: decode tokens/s and KV-cache bytes of each variant against the
        baseline."""
        path = os.path.join(self.out, "decode.json")
        argv = [sys.executable, "-m", "megatron_mea.cli.bench_decode", *self.plan.decode_flags,
                "--json", path]
        run = self.subprocess(argv, "decode.log", min(self.plan.decode_timeout_s,
                                                       self.remaining() - 5))
        if run["returncode"] != 0 or not os.path.exists(path):
            return {"ok": False, **failure(run, False)}
        with open(path, encoding="utf-8") as handle:
            table = summarize_decode(json.load(handle))
        return {"ok": bool(table["rows"]), **table, **failure(run, True)}

    def paged_kernel(self) -> dict:
        """Step: the Triton kernel of MEA's scaled-components cache in vLLM, driven directly
        (`acceptance/paged_kernel.py`): exact against the composite-head attention in fp32 and
        bf16, timed against the original's layout (the same kernel, SDPA). In the CPU smoke it
        runs tiny under Triton's interpreter; where triton does not import it is not available
        (decides nothing, named in the summary)."""
        path = os.path.join(self.out, "paged_kernel.json")
        argv = [sys.executable, "-m", "megatron_mea.apps.acceptance.paged_kernel", "--json", path]
        smoke = self.plan.mode != "gpu"
        run = self.subprocess(argv + (["--smoke"] if smoke else []), "paged_kernel.log",
                              min(self.plan.paged_kernel_timeout_s, self.remaining() - 5),
                              extra_env={"TRITON_INTERPRET": "1"} if smoke else None)
        if not os.path.exists(path):
            return {"ok": False, **failure(run, False)}
        with open(path, encoding="utf-8") as handle:
            result = json.load(handle)
        if result.get("not_available"):
            return {"ok": None, "not_available": result["not_available"], **failure(run, True)}
        ok = run["returncode"] == 0 and bool(result.get("ok"))
        return {"ok": ok, **summarize_paged_kernel(result), **failure(run, ok)}

    def megatron_lm(self) -> dict:
        """Step: Megatron-LM's own `pretrain_gpt.py`, a few bf16 steps with MEA and KHA, from
        the Megatron-LM training package vendored in the checkout (skipped without one)."""
        from megatron_mea.apps.acceptance.megatron_lm import megatron_lm_runs

        return megatron_lm_runs(self)

    def finish(self) -> int:
        """Record the verdict, write `acceptance.json` and `summary.txt`; the exit status (0
        passed, 1 not). A step that was not available here (`not_available`) is reported but
        decides nothing; a step skipped for lack of time fails the run."""
        steps = self.result["steps"]
        self.result["ok"] = all(row.get("ok") for row in steps.values()
                                if not row.get("not_available"))
        self.result["skipped"] = {name: why(row) for name, row in steps.items()
                                  if row.get("out_of_time") or row.get("not_available")}
        for name, reason in self.result["skipped"].items():
            logger.info("skipped: %s (%s)", name, reason)
        self.write()
        with open(os.path.join(self.out, "summary.txt"), "w", encoding="utf-8") as handle:
            handle.write(summary(self.result) + "\n")
        return 0 if self.result["ok"] else 1
