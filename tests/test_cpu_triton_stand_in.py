"""megatron_mea.cpu.triton_stand_in: exactly what Megatron-Core's batch-invariant kernels read
when imported, and a clear failure for anything else (the runner's L8)."""

import subprocess
import sys

import pytest

from megatron_mea.cpu.triton_stand_in import triton_modules


def test_the_stand_in_has_only_jit_and_constexpr():
    modules = triton_modules()
    triton, language = modules["triton"], modules["triton.language"]
    assert triton.language is language
    public = {name for name in vars(triton) if not name.startswith("__")}
    assert public == {"jit", "language"}
    assert {name for name in vars(language) if not name.startswith("__")} == {"constexpr"}


def test_a_kernel_it_decorated_fails_when_launched_saying_why():
    triton = triton_modules()["triton"]

    def kernel(x):
        return x

    for decorated in (triton.jit(kernel), triton.jit(launch_metadata=None)(kernel)):
        assert decorated.__name__ == "kernel"
        with pytest.raises(RuntimeError, match=r"kernel\[grid\].*triton is not installed"):
            decorated[(1,)](1)
        with pytest.raises(RuntimeError, match="batch_invariant_kernels"):
            decorated(1)


def test_another_name_fails_naming_the_stand_in():
    modules = triton_modules()
    with pytest.raises(AttributeError, match="triton.cdiv: .*triton_stand_in"):
        modules["triton"].cdiv(1, 2)
    with pytest.raises(AttributeError, match="triton.language.program_id: "):
        modules["triton.language"].program_id(0)
    assert getattr(modules["triton"], "autotune", None) is None  # getattr's default still works


STAND_IN_IMPORT = """
import importlib, sys
from megatron_mea.cpu.triton_stand_in import triton_modules
name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
importlib.import_module(name.rsplit(".", 1)[0])  # the rest of Megatron-Core as installed
sys.modules.pop(name, None)
sys.modules.update(triton_modules())
module = importlib.import_module(name)
assert module.triton is sys.modules["triton"], "the module did not import the stand-in"
print("IMPORTED")
"""


def test_megatron_cores_batch_invariant_kernels_import_with_it():
    # A fresh interpreter: the stand-in must not leak into this session's sys.modules.
    result = subprocess.run([sys.executable, "-c", STAND_IN_IMPORT], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "IMPORTED" in result.stdout, result.stderr[-3000:]
