"""megatron_mea.cpu: scoped and reversible, applied only without CUDA, and what it patches works."""

import subprocess
import sys

import pytest
import torch

from megatron_mea.cpu import cuda_device_to_cpu, megatron_on_cpu


def _run(code: str) -> str:
    """Run `code` in a fresh interpreter (no test session's patches) and return its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


_WITH_CUDA = """
import torch
torch.cuda.is_available = lambda: True
original = torch.cuda.current_device
from megatron_mea.cpu import megatron_on_cpu
from megatron.core.transformer.torch_norm import WrappedTorchNorm
new = WrappedTorchNorm.__new__
with megatron_on_cpu() as patched:
    assert patched is False
    assert torch.cuda.current_device is original
    assert WrappedTorchNorm.__new__ is new
print("untouched")
"""


@pytest.mark.slow
def test_nothing_is_patched_when_cuda_is_available():
    assert "untouched" in _run(_WITH_CUDA)


_REVERSIBLE = """
import torch
from megatron.core.fusions import fused_softmax
from megatron.core.optimizer import optimizer
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron_mea.cpu import megatron_on_cpu

def snapshot():
    return (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.synchronize,
            WrappedTorchNorm.__dict__["__new__"], token_dispatcher.maybe_move_tensor_to_cpu,
            fused_softmax.get_default_causal_mask, optimizer.clip_grad_by_total_norm_fp32)

before = snapshot()
with megatron_on_cpu() as patched:
    assert patched is True
    inside = snapshot()
    assert all(a is not b for a, b in zip(before, inside))
    assert torch.cuda.current_device() == torch.device("cpu")
    with megatron_on_cpu():  # nested: nothing re-patched, nothing restored early
        assert snapshot() == inside
    assert snapshot() == inside
assert snapshot() == before
print("restored")
"""


@pytest.mark.slow
def test_patches_are_undone_when_the_outermost_block_ends():
    assert "restored" in _run(_REVERSIBLE)


_MISSING = """
import torch
from megatron.core.transformer.moe import token_dispatcher
from megatron_mea.cpu import megatron_on_cpu
original = torch.cuda.current_device
del token_dispatcher.maybe_move_tensor_to_cpu
try:
    with megatron_on_cpu():
        pass
except AttributeError as exc:
    print(exc)
assert torch.cuda.current_device is original  # the patches made before the failure are undone
"""


def test_a_missing_patch_target_is_named():
    out = _run(_MISSING)
    assert "maybe_move_tensor_to_cpu does not exist in Megatron-Core" in out


def test_cuda_device_arguments_become_cpu_inside_the_context():
    with cuda_device_to_cpu():
        a = torch.zeros(3, device="cuda")
        b = torch.ones(2, device=torch.device("cuda", 0)).to("cuda")
        c = torch.empty(1, device=0)
    assert {a.device.type, b.device.type, c.device.type} == {"cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU patch P5")
def test_sequence_parallel_torch_norm_marks_its_params(single_rank):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests._models import tiny_config

    with megatron_on_cpu():
        config = tiny_config()
        config.sequence_parallel = True  # as at TP>1; the norm itself does not look at TP
        norm = WrappedTorchNorm(config, 64)
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(4, 2, 64)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-5))


def test_library_entry_points_outside_the_patches_say_so_in_one_line(tmp_path):
    # A fresh interpreter: the test session itself runs inside megatron_on_cpu().
    import subprocess
    import sys

    script = (
        "import torch\n"
        "assert not torch.cuda.is_available()\n"
        "from megatron_mea.inference import load_for_inference, load_model\n"
        "from megatron_mea.apps.training.loop import Trainer\n"
        "from megatron_mea.apps.training.arguments import parse_run\n"
        "from megatron_mea.cpu import megatron_on_cpu\n"
        "for call in (lambda: load_for_inference('nowhere'), lambda: load_model('nowhere'),\n"
        "             lambda: Trainer(*parse_run(['--mock-data']))):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as exc:\n"
        "        print(exc)\n"
        "with megatron_on_cpu():\n"
        "    try:\n"
        "        load_model('nowhere')\n"
        "    except FileNotFoundError:\n"
        "        print('inside: the checkpoint is looked for')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 4, result.stdout
    for entry, line in zip(("load_for_inference", "load_model", "Trainer"), lines):
        assert line.startswith(f"{entry} runs Megatron-Core, which needs CUDA or the CPU patches")
        assert "with megatron_mea.cpu.megatron_on_cpu():" in line
    assert lines[3] == "inside: the checkpoint is looked for"
