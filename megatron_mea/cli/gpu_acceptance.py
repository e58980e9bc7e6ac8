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

The steps live in `megatron_mea.acceptance`. This module and that package import only the
standard library at load time: the bootstrap calls `--missing-wheels` before megatron-core is
installed.
"""

import argparse
import dataclasses
import logging
import os
import sys

from megatron_mea.acceptance.environment import missing_wheels
from megatron_mea.acceptance.plans import GPU_PLAN, SMOKE_PLAN
from megatron_mea.acceptance.report import summary
from megatron_mea.acceptance.runner import Runner
from megatron_mea.acceptance.worker import train_worker

logger = logging.getLogger("megatron_mea.acceptance")


def _log_to_stdout() -> None:
    """The acceptance modules' progress lines on stdout, prefixed; Megatron's own INFO logs
    stay quiet as in any process that configures no logging."""
    if logger.handlers:  # main() called again in one process
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[acceptance] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


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
    _log_to_stdout()
    if args.train_worker:
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
    out = args.out or os.environ.get("OUT") or os.path.join("runs", "gpu_acceptance")
    os.makedirs(out, exist_ok=True)
    runner = Runner(plan, os.path.abspath(out), args.peak_tflops)
    logger.info("mode %s, output %s, budget %s s", plan.mode, runner.out, plan.budget_s)
    runner.step("environment", runner.environment, 0)
    steps = [("gpu_tests", runner.gpu_tests, 30), ("training", runner.training, 60),
             ("layer_bench", runner.layer_bench, 30)]
    for name, function, minimum in steps:
        if name not in args.skip:
            runner.step(name, function, minimum)
    status = runner.finish()
    print("\n" + summary(runner.result), flush=True)
    logger.info("wrote %s and summary.txt", os.path.join(runner.out, "acceptance.json"))
    return status


if __name__ == "__main__":
    sys.exit(main())
