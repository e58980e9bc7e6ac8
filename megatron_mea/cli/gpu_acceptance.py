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

The run and its steps live in `megatron_mea.apps.acceptance` (`session`, `runner`). This module
and that package import only the standard library at load time: the bootstrap installs the
wheels (`python -m megatron_mea.apps.acceptance.install`) before megatron-core is there.
"""

import argparse
import dataclasses
import os
import sys

from megatron_mea.apps.acceptance.plans import GPU_PLAN, SMOKE_PLAN
from megatron_mea.apps.acceptance.session import STEPS, log_to_stdout, run_acceptance
from megatron_mea.apps.acceptance.worker import train_worker
from megatron_mea.runtime.argparsing import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    """The flags (the hidden ones are the bootstrap's and the training worker's)."""
    parser = ArgumentParser(prog="mea-gpu-acceptance", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="where the packed report goes, at most four files "
                             "(default: $OUT, else runs/gpu_acceptance)")
    parser.add_argument("--report-dir", default=os.path.join("runs", "gpu_acceptance-report"),
                        help="the full, unpacked report (emptied first). "
                             "Default: runs/gpu_acceptance-report")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every step at tiny sizes on the CPU (no GPU needed)")
    parser.add_argument("--skip", nargs="+", default=[],
                        choices=[name for name, _ in STEPS],
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
        log_to_stdout()
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
    return run_acceptance(plan, report_dir, out, args.peak_tflops, args.skip)


if __name__ == "__main__":
    sys.exit(main())
