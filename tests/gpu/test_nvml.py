"""NVML telemetry (nvidia-ml-py): the values mea-pretrain logs on every step."""

import pytest


@pytest.mark.gpu
def test_gpu_telemetry_reads_memory_utilisation_and_power():
    import torch

    from megatron_mea.apps.training.monitor import GpuTelemetry, format_line

    keep = torch.ones(64, 2**20, device="cuda")  # 256 MiB in use, at least
    values = GpuTelemetry().read()
    assert set(values) == {"gpu_mem_gib", "gpu_util_pct", "gpu_power_w"}, values
    assert values["gpu_mem_gib"] > 0.25
    assert 0.0 <= values["gpu_util_pct"] <= 100.0
    assert values["gpu_power_w"] > 0.0
    line = format_line(3, 10, {"lm loss": 2.5, **values})
    assert "gpu_mem_gib" in line and "gpu_power_w" in line and "3/10" in line
    del keep
