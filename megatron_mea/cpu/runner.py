"""Megatron-LM's own scripts (``pretrain_gpt.py``...) on a CPU-only torch: the module runner.

``python -m megatron_mea.cpu SCRIPT [ARGS...]`` (or ``torchrun --nproc-per-node N -m
megatron_mea.cpu SCRIPT ...``) runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``
and the script's folder first on ``sys.path``, as ``python SCRIPT`` would. Without CUDA it runs
it inside :func:`megatron_mea.cpu.megatron_on_cpu` (Megatron-Core's patches P1-P9,
`megatron_mea.cpu.megatron_core`), :func:`megatron_lm_on_cpu` (Megatron-LM's
``megatron.training``, below) and :func:`megatron_mea.cpu.cuda_device_to_cpu` (every
``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` in Megatron-LM's loop stays on CPU). With
CUDA it patches nothing and runs the script as is.

Paths are relative to a Megatron-LM checkout; "0.16" is tag ``core_v0.16.1``, "0.19" is
``core_v0.19.0``. Like ``megatron_on_cpu``, every patch is undone when the block ends, and each
checks that what it replaces exists, failing with the name of the missing attribute.

L1 ``initialize_megatron``'s ``allow_no_cuda`` defaults to True (0.16, 0.19). Symptom:
   ``AssertionError: Megatron requires CUDA.`` (``megatron/training/initialize.py:62`` in 0.16,
   ``:66`` in 0.19). ``pretrain()`` never passes the argument.
L2 ``torch.cuda.device_count`` returns 1, ``torch.cuda.set_device`` does nothing (0.16, 0.19).
   Symptom: with 0 devices ``_initialize_distributed`` never builds the model-parallel groups
   (``initialize.py:319,360`` in 0.16, ``:270,358`` in 0.19), and the seeding skips the RNG
   tracker (``:422`` / ``:447``); ``set_device`` (``:331`` / ``:282``) needs a GPU. Safe: the one
   "device" is the CPU that every rank runs on.
L3 ``tensor_parallel.random.CudaRNGStatesTracker`` keeps CPU generator states (0.16, 0.19).
   ``model_parallel_cuda_manual_seed`` (``initialize.py:423`` in 0.16, ``:451`` in 0.19) builds
   this tracker and ``add``s the data-, tensor- and expert-parallel seeds, which reads the CUDA
   RNG state (``tensor_parallel/random.py``). The stand-in seeds a CPU ``torch.Generator`` state
   per name, and ``fork`` swaps it into the global CPU generator (which CPU dropout draws from)
   as the original does with the CUDA one. Its states are non-empty, so the checkpoint's
   ``rng_tracker_states`` save and restore: with :func:`megatron_mea.cpu.init_cpu_rng_tracker`'s
   tracker (no states) ``load_checkpoint`` prints "Unable to load rng state" and exits
   (``checkpointing.py:1866-1892`` in 0.16, ``:2665-2693`` in 0.19).
L4 ``torch.cuda.get_rng_state`` returns an empty state, ``set_rng_state`` ignores it (0.16, 0.19).
   ``megatron/core/rerun_state_machine.py:957`` (0.16) / ``:979`` (0.19) and
   ``megatron/training/checkpointing.py:343`` (0.16) / ``:417`` (0.19) save and restore it with
   the other RNG states. Safe: a CPU-only torch has no CUDA generator to save or restore.
L5 ``megatron.legacy.fused_kernels.load`` does nothing (0.16 only; 0.19 dropped the call).
   ``initialize.py:224,228`` in 0.16 build Megatron's fused CUDA kernels. Safe: nothing on CPU
   can use them; Megatron-Core's unfused paths run instead.
L6 ``get_device_arch_version`` (as ``megatron/training/arguments.py`` imported it) returns 0
   (0.16, 0.19). Symptom: ``torch.cuda.get_device_properties`` fails in argument validation with
   TP or CP > 1 (``arguments.py:928`` in 0.16, ``:1414`` in 0.19). 0 keeps the pre-Blackwell
   checks, so TP > 1 needs ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as on a Hopper GPU.
L7 ``megatron.core.datasets.utils.compile_helpers`` skips ``make`` when the folder has no
   ``Makefile`` and the built ``helpers_cpp`` imports (0.16, 0.19). Symptom: ``make: *** No
   targets specified and no makefile found`` then exit 1 (``initialize.py:190-192`` in 0.16,
   ``:176-178`` in 0.19): the megatron-core wheel ships the built helper but not the Makefile.
   With a Makefile (a checkout's own ``megatron/core`` first on ``PYTHONPATH``) ``make`` runs as
   before, and then needs ``pybind11``.
L8 (no attribute) at 0.16 only, ``megatron/core/transformer/custom_layers/
   batch_invariant_kernels.py:15`` imports ``triton`` unconditionally, and
   ``megatron/training/initialize.py:25`` imports that module. When that import fails for want
   of ``triton``, the runner imports the module once more with
   `megatron_mea.cpu.triton_stand_in` in ``sys.modules`` (the two names the import reads; a
   kernel launched or another name read fails saying why), then removes the stand-in. 0.19
   guards the import itself (``batch_invariant_kernels.py:16-28``), so it imports as it is.
   ``--batch-invariant-mode`` needs real triton kernels (and a GPU) either way.
"""

import builtins
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path
from typing import Iterator, List, Optional

import torch

from megatron_mea.cpu.megatron_core import _Patcher, cuda_device_to_cpu, megatron_on_cpu
from megatron_mea.cpu.triton_stand_in import triton_modules
from megatron_mea.runtime.process_groups import set_up_world_of_one

logger = logging.getLogger(__name__)

__all__ = ["main", "megatron_lm_on_cpu", "run_script"]

USAGE = "usage: python -m megatron_mea.cpu SCRIPT [ARGS...]"


def _l1_allow_no_cuda(patch: _Patcher) -> None:
    from megatron.training import initialize

    function = patch.get(initialize, "initialize_megatron")
    names = function.__code__.co_varnames[:function.__code__.co_argcount]
    defaults = list(patch.get(function, "__defaults__"))
    if "allow_no_cuda" not in names:
        raise AttributeError("initialize_megatron has no allow_no_cuda parameter: "
                             "megatron_mea.cpu.runner must be updated for this Megatron-LM")
    # The defaults cover the last len(defaults) positional parameters.
    defaults[names.index("allow_no_cuda") - (len(names) - len(defaults))] = True
    patch.replace(function, "__defaults__", tuple(defaults))


def _l2_one_device(patch: _Patcher) -> None:
    patch.replace(torch.cuda, "device_count", lambda: 1)
    patch.replace(torch.cuda, "set_device", lambda device: None)


def _l3_cpu_rng_tracker(patch: _Patcher) -> None:
    from megatron.core.tensor_parallel import random as tp_random

    base = patch.get(tp_random, "CudaRNGStatesTracker")
    default_name = patch.get(tp_random, "_MODEL_PARALLEL_RNG_TRACKER_NAME")

    class CpuRNGStatesTracker(base):
        """Megatron's tracker over the CPU generator (the bookkeeping is the original's)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    patch.replace(tp_random, "CudaRNGStatesTracker", CpuRNGStatesTracker)


def _l4_cuda_rng_state(patch: _Patcher) -> None:
    patch.replace(torch.cuda, "get_rng_state",
                  lambda device="cuda": torch.empty(0, dtype=torch.uint8))
    patch.replace(torch.cuda, "set_rng_state", lambda new_state, device="cuda": None)


def _l5_fused_kernels(patch: _Patcher) -> None:
    try:
        from megatron.legacy import fused_kernels
    except ImportError:  # 0.19 has no megatron.legacy and no call to it
        return
    patch.replace(fused_kernels, "load", lambda args: None)


def _l6_device_arch_version(patch: _Patcher) -> None:
    from megatron.training import arguments

    patch.replace(arguments, "get_device_arch_version", lambda: 0)


def _l7_dataset_helpers(patch: _Patcher) -> None:
    from megatron.core.datasets import utils as dataset_utils

    original = patch.get(dataset_utils, "compile_helpers")
    folder = Path(dataset_utils.__file__).parent

    def compile_helpers():
        if not (folder / "Makefile").exists() and _helpers_built():
            logger.info("%s has no Makefile: using its built helpers_cpp", folder)
            return
        original()

    patch.replace(dataset_utils, "compile_helpers", compile_helpers)


def _helpers_built() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


_PATCHES = (
    _l1_allow_no_cuda,
    _l2_one_device,
    _l3_cpu_rng_tracker,
    _l4_cuda_rng_state,
    _l5_fused_kernels,
    _l6_device_arch_version,
    _l7_dataset_helpers,
)

_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _import_batch_invariant_without_triton() -> None:
    """L8: import 0.16's batch_invariant_kernels with the triton stand-in if triton is missing."""
    if _BATCH_INVARIANT in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    # Its package first, outside the try: the stand-in is for this one module's import only.
    importlib.import_module(_BATCH_INVARIANT.rsplit(".", 1)[0])
    try:
        importlib.import_module(_BATCH_INVARIANT)  # 0.19: guarded, imports without triton
        return
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
    stand_ins = triton_modules()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        importlib.import_module(_BATCH_INVARIANT)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    logger.info("triton is not installed: %s imported with a stand-in", _BATCH_INVARIANT)


@contextlib.contextmanager
def megatron_lm_on_cpu() -> Iterator[bool]:
    """Megatron-Core and Megatron-LM's ``megatron.training`` patched for a CPU-only torch.

    Yields False and patches nothing when CUDA is available. Inside it, ``megatron_on_cpu``'s
    patches and ``cuda_device_to_cpu`` are active too. ``megatron.training`` must be importable
    (a Megatron-LM checkout, or the part of it that the script needs, on ``sys.path``).

    Raises:
        AttributeError: if an attribute a patch replaces is missing (another Megatron-LM).
    """
    if torch.cuda.is_available():
        yield False
        return
    _import_batch_invariant_without_triton()
    with megatron_on_cpu(), contextlib.ExitStack() as undo:
        patcher = _Patcher(undo)
        for patch in _PATCHES:
            patch(patcher)
        logger.info("Megatron-LM CPU patches applied: %s", [p.__name__ for p in _PATCHES])
        with cuda_device_to_cpu():
            yield True


def run_script(script: str, args: List[str]) -> None:
    """Run `script` as ``__main__`` with `args`, as ``python script args...`` would.

    Raises:
        FileNotFoundError: if `script` does not exist.
    """
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"SCRIPT {script!r} does not exist ({USAGE})")
    code = compile(path.read_bytes(), str(path), "exec")
    # The script's namespace is `__main__`, but its spec names the runner's `__main__.py`:
    # processes that Megatron starts with multiprocessing's "spawn" (the checkpoint writer's
    # result queue) then skip the main module, as for any `python -m package` (a name ending
    # in `.__main__`), instead of importing the script, which outside the patches can fail to
    # import (L8) and would re-import all of Megatron-LM.
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(__file__=str(path), __builtins__=builtins,
                                __spec__=importlib.util.find_spec("megatron_mea.cpu.__main__"))
    saved = sys.argv, list(sys.path), sys.modules["__main__"]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules["__main__"] = main_module
    try:
        with megatron_lm_on_cpu():
            exec(code, main_module.__dict__)
    finally:
        sys.argv, sys.path[:], sys.modules["__main__"] = saved


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m megatron_mea.cpu SCRIPT [ARGS...]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n")[1])
        raise SystemExit(0 if argv else 2)
    logging.basicConfig(level=os.environ.get("MEA_LOG_LEVEL", "WARNING"))
    # Megatron-LM's initialize reads the env:// rendezvous that torchrun sets; without it
    # (`python -m megatron_mea.cpu SCRIPT`) torch stops at `MASTER_ADDR expected, but not set`.
    set_up_world_of_one()
    run_script(argv[0], argv[1:])
