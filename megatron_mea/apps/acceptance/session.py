"""One `mea-gpu-acceptance` run, from the report folder to the packed report: its console (the
acceptance modules' progress lines on stdout and in `console.log`), the steps in order under the
run's time budget (`runner.Runner`), the summary, and the packing (`pack`).

Imports only the standard library at load time, as the whole package.
"""

import logging
import os
import shutil
import sys
import tempfile
from typing import Iterable, Optional

from megatron_mea.apps.acceptance.pack import pack_report
from megatron_mea.apps.acceptance.plans import Plan
from megatron_mea.apps.acceptance.report import summary
from megatron_mea.apps.acceptance.runner import Runner

# The logger of every acceptance module (their loggers are its children).
LOGGER = "megatron_mea.apps.acceptance"
logger = logging.getLogger(LOGGER)
# The steps after `environment`, in order, each with the seconds it needs at least (a step that
# no longer fits the budget is skipped and named).
STEPS = (("gpu_tests", 30), ("training", 60), ("decode_bench", 30), ("paged_kernel", 20),
         ("megatron_lm", 40), ("layer_bench", 30))


def log_to_stdout(console_log=None) -> None:
    """The acceptance modules' progress lines on stdout, prefixed, and in `console_log` if
    given; Megatron's own INFO logs stay quiet as in any process that configures no logging."""
    logger = logging.getLogger(LOGGER)
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


def run_acceptance(plan: Plan, report_dir: str, out: str, peak_tflops: Optional[float],
                   skip: Iterable[str] = ()) -> int:
    """Run the acceptance steps into `report_dir` (emptied first) and pack it into `out`.

    Args:
        plan: sizes, time limits and the budget (`plans.GPU_PLAN`, `plans.SMOKE_PLAN`).
        report_dir: the full, unpacked report.
        out: where the packed report goes (at most four files).
        peak_tflops: the GPU's dense bf16 peak for MFU; None: from its name.
        skip: names of `STEPS` to leave out.

    Returns:
        The exit status: 0 when every step passed, 1 when one failed.
    """
    shutil.rmtree(report_dir, ignore_errors=True)
    os.makedirs(report_dir)
    log_to_stdout(os.path.join(report_dir, "console.log"))
    scratch = tempfile.mkdtemp(prefix="mea-acceptance-")
    try:
        runner = Runner(plan, report_dir, peak_tflops, scratch)
        logger.info("mode %s, report %s, packed into %s, budget %s s", plan.mode, report_dir,
                    out, plan.budget_s)
        runner.step("environment", runner.environment, 0)
        for name, minimum in STEPS:
            if name not in skip:
                runner.step(name, getattr(runner, name), minimum)
        status = runner.finish()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("summary:\n%s", summary(runner.result))
    written = pack_report(report_dir, out)
    logger.info("packed the report into %s: %s", out, ", ".join(written))
    return status
