"""megatron_mea.cpu: applied only without CUDA, idempotent, and what it patches works."""

import subprocess
import sys

import torch

from megatron_mea.cpu import apply_cpu_patches, cuda_device_to_cpu

_WITH_CUDA = """
import torch
torch.cuda.is_available = lambda: True
original = torch.cuda.current_device
from megatron_mea.cpu import apply_cpu_patches
from megatron.core.transformer.torch_norm import WrappedTorchNorm
new = WrappedTorchNorm.__new__
assert apply_cpu_patches() is False
assert torch.cuda.current_device is original
assert WrappedTorchNorm.__new__ is new
print("untouched")
"""


def test_nothing_is_patched_when_cuda_is_available():
    out = subprocess.run([sys.executable, "-c", _WITH_CUDA], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "untouched" in out.stdout


def test_patches_apply_once_without_cuda():
    assert apply_cpu_patches() is True
    patched = torch.cuda.current_device
    assert apply_cpu_patches() is True
    assert torch.cuda.current_device is patched
    assert patched() == torch.device("cpu")


def test_cuda_device_arguments_become_cpu_inside_the_context():
    apply_cpu_patches()
    with cuda_device_to_cpu():
        a = torch.zeros(3, device="cuda")
        b = torch.ones(2, device=torch.device("cuda", 0)).to("cuda")
        c = torch.empty(1, device=0)
    assert {a.device.type, b.device.type, c.device.type} == {"cpu"}


def test_sequence_parallel_torch_norm_marks_its_params(single_rank):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests._models import tiny_config

    config = tiny_config()
    config.sequence_parallel = True  # as at TP>1; the norm itself does not look at TP
    norm = WrappedTorchNorm(config, 64)
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(4, 2, 64)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-5))
