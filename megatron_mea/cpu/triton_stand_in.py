"""A stand-in for a missing ``triton``, for one import: Megatron-Core 0.16's batch-invariant
kernels (the runner's L8, `megatron_mea.cpu.runner`).

Why: at 0.16.1 ``megatron/core/transformer/custom_layers/batch_invariant_kernels.py:15-16``
imports ``triton`` and ``triton.language`` unconditionally, and Megatron-LM's
``megatron/training/initialize.py:25`` imports that module, so without triton (a CPU-only
torch has none) no Megatron-LM script starts. 0.19 guards the import itself.

What the import uses, and so all the stand-in has:

- ``triton.jit``, bare (``@triton.jit``) and with options
  (``@triton.jit(launch_metadata=...)``), on the module's three kernels;
- ``triton.language.constexpr``, in the kernels' parameter annotations (evaluated when each
  ``def`` runs).

What breaks: nothing at import. A kernel it decorated raises `RuntimeError` when launched
(``kernel[grid](...)``) or called, and any other name of either module raises `AttributeError`
naming this stand-in: both only under ``--batch-invariant-mode``, which needs real triton
kernels and a GPU in any case.
"""

import types
from typing import Callable, Dict, Optional

__all__ = ["triton_modules"]

_WHY = ("triton is not installed: megatron_mea.cpu.triton_stand_in stands in for it only so "
        "that Megatron-Core's batch_invariant_kernels imports (--batch-invariant-mode needs "
        "triton and a GPU)")


class _MissingKernel:
    """What ``@triton.jit`` makes of a kernel: a name that fails when the kernel is launched."""

    def __init__(self, function: Callable):
        self.__name__ = function.__name__
        self.__wrapped__ = function

    def __getitem__(self, grid):
        raise RuntimeError(f"{self.__name__}[grid](...): {_WHY}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__}(...): {_WHY}")


def _jit(function: Optional[Callable] = None, **options):
    """``@triton.jit`` and ``@triton.jit(**options)`` (the options are ignored)."""
    if function is None:
        return _jit
    return _MissingKernel(function)


class _Constexpr:
    """``tl.constexpr``: only read as a parameter annotation here."""


def _module(name: str, attributes: Dict[str, object]) -> types.ModuleType:
    module = types.ModuleType(name, f"Stand-in for {name}: see megatron_mea.cpu.triton_stand_in.")
    module.__dict__.update(attributes)

    def __getattr__(attribute: str):
        raise AttributeError(f"{name}.{attribute}: {_WHY}")

    # PEP 562: a name the stand-in lacks fails with the reason, not a bare AttributeError.
    module.__getattr__ = __getattr__
    return module


def triton_modules() -> Dict[str, types.ModuleType]:
    """New ``triton`` and ``triton.language`` stand-ins, by the name each takes in
    ``sys.modules``."""
    language = _module("triton.language", {"constexpr": _Constexpr})
    triton = _module("triton", {"jit": _jit, "language": language})
    return {"triton": triton, "triton.language": language}
