"""What a run reports: GPU telemetry (nvidia-ml-py), TensorBoard scalars, the console line,
metrics.jsonl."""

import json
import logging
import os
from typing import Optional

import torch

from megatron_mea._optional import import_extra
from megatron_mea.checkpoint.torch_dist.save_failures import describe_failure

logger = logging.getLogger(__name__)


class GpuTelemetry:
    """Memory, utilisation and power of this rank's GPU through NVML.

    Without a GPU, or without a working NVML, it logs a single notice and reports nothing.
    """

    def __init__(self):
        self._handle = None
        if not torch.cuda.is_available():
            logger.info("GPU telemetry off: no CUDA device")
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as exc:  # NVML missing or refusing: telemetry is optional
            logger.info("GPU telemetry off: %s", exc)

    def read(self) -> dict:
        """{'gpu_mem_gib', 'gpu_util_pct', 'gpu_power_w'} or {} without telemetry."""
        if self._handle is None:
            return {}
        nvml, handle = self._nvml, self._handle
        return {
            "gpu_mem_gib": nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30,
            "gpu_util_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "gpu_power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        }


class TensorBoard:
    """Scalars to TensorBoard event files under `directory` (rank 0 only; None disables)."""

    def __init__(self, directory):
        self._writer = None
        if directory:
            tensorboard = import_extra("torch.utils.tensorboard", "--tensorboard-dir")
            self._writer = tensorboard.SummaryWriter(log_dir=directory)

    def add(self, scalars: dict, step: int) -> None:
        """Write every scalar of `scalars` at `step`."""
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, step)
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()


def format_line(iteration: int, total: int, scalars: dict) -> str:
    """One Megatron-style log line: ` iteration 10/100 | lm loss: 4.1 | lr: ... |`."""
    parts = [f" iteration {iteration:>6}/{total}"]
    for name, value in scalars.items():
        parts.append(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")
    return " | ".join(parts) + " |"


def append_metrics(path: str, record: dict) -> Optional[str]:
    """Append `record` to metrics.jsonl as one line; returns None, or what failed (a full
    disk), in one line, after cutting the file back to its last whole line."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as exc:
        try:
            os.truncate(path, size)
        except OSError:
            pass  # a partial last line: readers of the file skip it
        return f"writing {path} failed: {describe_failure(exc)}"
    return None
