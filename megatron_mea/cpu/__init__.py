"""Megatron-Core and Megatron-LM on a CPU-only torch (gloo).

- `megatron_core`: the scoped, reversible patches Megatron-Core needs without CUDA
  (`megatron_on_cpu`, P1-P9) and the helpers around them; its docstring is the reference.
- `runner`: ``python -m megatron_mea.cpu SCRIPT [ARGS...]`` runs Megatron-LM's own scripts
  (``pretrain_gpt.py``...) with those patches and Megatron-LM's own (L1-L8).
- `triton_stand_in`: the module the runner puts in place of a missing triton for one import.

This package exports the library's names only (`megatron_mea.model.gpt` and the trainer use
them); the runner is an application of them, run as `python -m megatron_mea.cpu`.
"""

from megatron_mea.cpu.megatron_core import (
    cuda_device_to_cpu,
    init_cpu_rng_tracker,
    megatron_on_cpu,
    require_cpu_patches,
)

__all__ = ["cuda_device_to_cpu", "init_cpu_rng_tracker", "megatron_on_cpu", "require_cpu_patches"]
