"""`mea-gpu-acceptance`: everything that needs a GPU, checked in one run of under 8 minutes.

On a machine with one CUDA GPU (bootstrap with `scripts/gpu_acceptance.sh`, see docs/gpu.md):

1. environment: GPU, driver, CUDA, torch, NCCL, Transformer Engine (if importable),
   megatron-core, megatron_mea;
2. the GPU test tier, `pytest -m gpu tests/gpu` (bf16 layers against fp32, the TE spec, FP8,
   NCCL with the distributed optimizer, NVML telemetry);
3. training: baseline, MEA with virtual heads and KHA, a few hundred bf16 steps each on mock data
   through mea-pretrain's own argument parser and `Trainer`; checks that every loss is finite and
   that the loss falls; reports tokens/s, peak memory and MFU;
4. the decode benchmark (`mea-bench-decode`) in bf16 at contexts 2048 and 8192: decode tokens/s
   and KV-cache bytes of MEA (nc = ng and ng/2) and KHA against the baseline;
4b. the serving kernel (`megatron_mea.apps.acceptance.paged_kernel`): the Triton kernel of MEA's
   scaled-components cache in vLLM, exact against the composite heads in fp32 and bf16, and
   timed against the original's layout (the same kernel, SDPA) in decode and prefill;
5. Megatron-LM's own `pretrain_gpt.py` for a few bf16 steps with MEA and KHA, where the checkout
   carries Megatron-LM's training package (otherwise reported as not available);
6. the layer benchmark (`mea-bench-attention`) in bf16 at hidden 2048 (16/4 heads) and 4096
   (32/8), sequence 4096: step-time ratios to the baseline and TFLOP/s, with the SDPA and the
   unfused core attention of the local spec, and with the TE spec when TE imports.

The whole run keeps to a time budget (465 s on a GPU): a step that no longer fits is skipped and
named. Everything is written under `--report-dir` (default `runs/gpu_acceptance-report`) and then
packed into at most four files in `--out` (default `$OUT`, else `runs/gpu_acceptance`):
`summary.txt`, `acceptance.json`, `console.log` and `report.tar.gz` (the step logs and records).
Exit status 0 when every step passed, 1 when one failed, 2 without a CUDA device (unless
`--cpu-smoke`).

`--cpu-smoke` runs the same steps at tiny sizes on the CPU (fp32; the GPU tests are collected and
skipped), so that the script keeps working without a GPU; `tests/test_gpu_acceptance.py` runs it.

    bash scripts/gpu_acceptance.sh                 # GPU machine: install wheels/, then this
    python -m megatron_mea.cli.gpu_acceptance --cpu-smoke --out /tmp/smoke

The steps live in `megatron_mea.apps.acceptance`. This module and that package import only the
standard library at load time: the bootstrap installs the wheels
(`python -m megatron_mea.apps.acceptance.install`) before megatron-core is there.
"""

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import tempfile

from megatron_mea.apps.acceptance.pack import pack_report
from megatron_mea.apps.acceptance.plans import GPU_PLAN, SMOKE_PLAN
from megatron_mea.apps.acceptance.report import summary
from megatron_mea.apps.acceptance.runner import Runner
from megatron_mea.apps.acceptance.worker import train_worker
from megatron_mea.runtime.argparsing import ArgumentParser

logger = logging.getLogger("megatron_mea.apps.acceptance")


def _log_to_stdout(console_log=None) -> None:
    """The acceptance modules' progress lines on stdout, prefixed, and in `console_log` if
    given; Megatron's own INFO logs stay quiet as in any process that configures no logging."""
    for handler in list(logger.handlers):  # main() called again in one process
        logger.removeHandler(handler)
        handler.close()
    handlers = [logging.StreamHandler(sys.stdout)]
    if console_log:
        handlers.append(logging.FileHandler(console_log, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(logging.Formatter("[acceptance] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def build_parser() -> argparse.ArgumentParser:
    """The flags (the hidden ones are the bootstrap's and the training worker's)."""
    parser = ArgumentParser(prog="mea-gpu-acceptance",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="where the packed report goes, at most four files "
                             "(default: $OUT, else runs/gpu_acceptance)")
    parser.add_argument("--report-dir", default=os.path.join("runs", "gpu_acceptance-report"),
                        help="the full, unpacked report (emptied first). "
                             "Default: runs/gpu_acceptance-report")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every step at tiny sizes on the CPU (no GPU needed)")
    parser.add_argument("--skip", nargs="+", default=[],
                        choices=["gpu_tests", "training", "decode_bench", "paged_kernel",
                                 "megatron_lm", "layer_bench"],
                        help="steps to leave out")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak for MFU (default: from its name)")
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="seconds of training per variant (default: 30 on a GPU)")
    parser.add_argument("--budget-s", type=int, default=None,
                        help="the whole run's time budget; steps that no longer fit are skipped "
                             "(default 465 on a GPU)")
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
    if args.train_worker:
        _log_to_stdout()
        return train_worker(args.train_worker)

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
    out = os.path.abspath(args.out or os.environ.get("OUT")
                          or os.path.join("runs", "gpu_acceptance"))
    report_dir = os.path.abspath(args.report_dir)
    if report_dir == out:
        print("mea-gpu-acceptance: --report-dir must differ from --out (the report is packed "
              "into --out)", file=sys.stderr)
        return 2
    shutil.rmtree(report_dir, ignore_errors=True)
    os.makedirs(report_dir)
    _log_to_stdout(os.path.join(report_dir, "console.log"))
    scratch = tempfile.mkdtemp(prefix="mea-acceptance-")
    try:
        runner = Runner(plan, report_dir, args.peak_tflops, scratch)
        logger.info("mode %s, report %s, packed into %s, budget %s s", plan.mode, report_dir,
                    out, plan.budget_s)
        runner.step("environment", runner.environment, 0)
        steps = [("gpu_tests", runner.gpu_tests, 30), ("training", runner.training, 60),
                 ("decode_bench", runner.decode_bench, 30),
                 ("paged_kernel", runner.paged_kernel, 20),
                 ("megatron_lm", runner.megatron_lm, 40),
                 ("layer_bench", runner.layer_bench, 30)]
        for name, function, minimum in steps:
            if name not in args.skip:
                runner.step(name, function, minimum)
        status = runner.finish()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = summary(runner.result)
    print("\n" + text, flush=True)
    with open(os.path.join(report_dir, "console.log"), "a", encoding="utf-8") as handle:
        handle.write("\n" + text + "\n")
    written = pack_report(report_dir, out)
    logger.info("packed the report into %s: %s", out, ", ".join(written))
    return status


if __name__ == "__main__":
    sys.exit(main())
