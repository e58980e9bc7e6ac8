"""Megatron-Core on a CPU-only torch (gloo): a scoped, reversible set of patches.

Megatron-Core assumes a GPU in many places. Inside :func:`megatron_on_cpu` the few places that
a GPTModel (local spec, TP + SP + EP, MoE), ``dist_checkpointing`` and the non-distributed fp32
optimizer hit are patched; on leaving it every patched attribute gets its original value back.
With CUDA available it patches nothing, so behaviour on a GPU never changes. Only entry points
(the CLIs) and tests enter it; library functions never do. Each patch checks that the attribute
it replaces exists and fails naming it if a Megatron-Core release removed it.

Paths are relative to ``megatron/core``; "0.16" is 0.16.1, "0.19" is 0.19.2.

P1 ``torch.cuda.current_device`` returns ``torch.device("cpu")`` (0.16, 0.19).
   Symptom: ``AssertionError: Torch not compiled with CUDA enabled``. Megatron calls it about
   175 times as a *device* argument (``transformer/moe/router.py:90`` in 0.16, ``:98`` in 0.19,
   ``tensor_parallel/mappings.py``, ``utils.py``...). Safe: without CUDA the original can only
   raise.
P2 (moved) 0.16's unbound ``moe_utils.te_general_gemm`` without Transformer Engine is not a CPU
   problem: a GPU without TE fails the same way. :func:`megatron_mea.compat.
   bind_te_general_gemm_without_te` fixes it wherever TE is absent; the spec builders call it,
   and so does this context on entry (for models built from Megatron's own specs). The binding
   is Megatron-Core 0.17's own behaviour, so it is not undone on exit.
P3 ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` return a no-op CPU stream, and
   ``torch.cuda.synchronize`` is a no-op (0.16, 0.19). Symptom: ``RuntimeError: torch.cuda.Stream
   requires CUDA support`` in the alltoall dispatcher (``transformer/moe/token_dispatcher.py:445``
   in 0.16, ``:469,922-925`` in 0.19); ``Torch not compiled with CUDA enabled`` from
   ``dist_checkpointing.save`` (``strategies/filesystem_async.py``, ``async_utils.py``,
   ``fully_parallel.py``). Safe: CPU ops run in order, so a stream whose events are already
   complete, and a synchronize that waits for nothing, are exact. ``torch.cpu.Stream`` is not
   enough: its ``record_event()`` returns None, on which the dispatcher calls ``.synchronize()``.
P4 (no patch) ``model_parallel_cuda_manual_seed(seed)`` fails: ``CudaRNGStatesTracker.add``
   calls ``torch.cuda.get_rng_state`` (``tensor_parallel/random.py``), and without a tracker
   ``fork()`` raises "cuda rng state ... is not added". Use :func:`init_cpu_rng_tracker`
   instead; its ``fork()`` is a null context, so dropout inside TP regions draws from the global
   CPU generator (tests use dropout 0).
P5 ``WrappedTorchNorm`` (``transformer/torch_norm.py``) accepts ``sequence_parallel`` (0.16, 0.19).
   Symptom: ``AssertionError: sequence parallel not supported by torch LayerNorm``. A norm acts
   per token, so a sequence shard needs no change in forward; only the weight grads are partial
   per TP rank. The built norm's params get ``sequence_parallel = True``, as Megatron's
   ``FusedLayerNorm`` and TE's norms do, so ``finalize_model_grads`` all-reduces them over TP.
   Safe: only the SP case, which used to raise, changes. Norms built inside the context keep
   the marks after it ends.
P6 ``filesystem_async._process_memory`` returns 0, only when psutil is missing (0.16, 0.19).
   Symptom: ``dist_checkpointing.save`` hangs: the forked writer raises and the parent waits
   forever. Safe: the value is only logged at debug level.
P7 ``token_dispatcher.maybe_move_tensor_to_cpu`` honours ``as_numpy`` for CPU tensors (0.16, 0.19).
   Symptom: ``TypeError: all_to_all_single(): incompatible function arguments``: the original
   (``moe_utils.py:1093`` in 0.16, ``:1169`` in 0.19) converts only CUDA tensors, so the split
   sizes stay tensors. Safe: CUDA tensors still take the original path.
P8 ``fused_softmax.get_default_causal_mask`` / ``get_sliding_window_causal_mask`` build the
   mask on CPU (0.16, 0.19). Symptom: ``attention_mask=None`` into the local
   ``DotProductAttention`` hits ``device="cuda"`` (``transformer/utils.py:35,40`` in 0.16,
   ``:37,42`` in 0.19). Safe: the original runs, under :func:`cuda_device_to_cpu`.
P9 ``clip_grad_by_total_norm_fp32`` without the ``'torch.cuda.FloatTensor'`` assert
   (``optimizer/clip_grads.py:167`` in 0.16, ``:174`` in 0.19), rebound where
   ``optimizer/optimizer.py`` imported it; same scaling, the dtype check kept as fp32. The other
   optimizer / clip / checkpoint-exchange code creates tensors with ``device='cuda'``: run those
   calls inside :func:`cuda_device_to_cpu` rather than patching each one.

Setup in a CPU process (gloo, one process per rank)::

    with megatron_on_cpu():                      # before building any model
        torch.distributed.init_process_group("gloo", ...)
        parallel_state.initialize_model_parallel(...)
        init_cpu_rng_tracker(seed)               # instead of model_parallel_cuda_manual_seed
        model = GPTModel(config(use_cpu_initialization=True, ...))
        with cuda_device_to_cpu():               # optimizer build + step, fully-parallel dist-ckpt
            opt = get_megatron_optimizer(...); ...; opt.step()
"""

import contextlib
import logging
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

__all__ = ["cuda_device_to_cpu", "init_cpu_rng_tracker", "megatron_on_cpu", "require_cpu_patches"]

_MISSING = object()
_depth = 0  # how many megatron_on_cpu blocks are open; only the outermost patches


def _is_cuda(device) -> bool:
    """True for the ways Megatron names a CUDA device: "cuda", "cuda:0", torch.device, an index."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device arguments to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:  # `t.cuda()` on CPU: the tensor already is where we run
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_device_to_cpu() -> Iterator[None]:
    """Within the block, ``device='cuda'`` (or ``torch.device('cuda')``, ``'cuda:N'``, an int
    index) given to any torch function becomes ``'cpu'``, ``t.cuda()`` returns ``t`` and
    ``t.to('cuda')`` moves to CPU.

    Use it around Megatron code that allocates scratch tensors on a hard-coded CUDA device:
    ``get_megatron_optimizer`` and ``optimizer.step()`` (grad norm, clipping, found-inf),
    fully-parallel dist-ckpt save/load wrappers, ``tensor_parallel.broadcast_data``. It is a
    no-op when CUDA is available, so code wrapped in it runs unchanged on a GPU.
    """
    if torch.cuda.is_available():
        yield
        return
    with _CudaToCpuMode():
        yield


def init_cpu_rng_tracker(seed: int = 1234) -> None:
    """Seed torch and install Megatron's RNG tracker in a form that works without CUDA (P4).

    Call after ``parallel_state.initialize_model_parallel``, in place of
    ``tensor_parallel.model_parallel_cuda_manual_seed(seed)``. It seeds the global CPU generator
    (which ``use_cpu_initialization=True`` draws weights from), so every rank given the same
    seed builds the same master weights. On CPU it then runs
    ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)``:
    that tracker ignores ``add`` and its ``fork()`` is a null context, so no CUDA RNG state is
    read, and dropout in TP regions draws from the global generator. With CUDA it runs the stock
    ``model_parallel_cuda_manual_seed(seed, force_reset_rng=True)``, so tests stay portable.
    """
    from megatron.core.tensor_parallel import random as tp_random

    torch.manual_seed(seed)
    tp_random.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True
    )


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` and ``torch.cuda.Event`` on CPU: work is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


class _SequenceParallelOff:
    """A read-only view of a TransformerConfig that reports ``sequence_parallel=False``."""

    sequence_parallel = False

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


class _Patcher:
    """Sets attributes and records how to undo each on the given exit stack."""

    def __init__(self, undo: contextlib.ExitStack):
        self._undo = undo

    @staticmethod
    def get(owner, name: str):
        """`owner.name` as stored on `owner` itself (a class's own `__dict__` entry).

        Raises:
            AttributeError: if `owner` has no `name` (a Megatron-Core release moved it).
        """
        if isinstance(owner, type):
            value = owner.__dict__.get(name, _MISSING)
        else:
            value = getattr(owner, name, _MISSING)
        if value is _MISSING:
            from megatron_mea.compat import MEGATRON_CORE_VERSION

            raise AttributeError(
                f"{getattr(owner, '__name__', owner)}.{name} does not exist in Megatron-Core "
                f"{MEGATRON_CORE_VERSION}: megatron_mea.cpu must be updated for this release"
            )
        return value

    def replace(self, owner, name: str, value) -> None:
        """Replace the existing `owner.name` with `value` until the context closes."""
        original = self.get(owner, name)
        setattr(owner, name, value)
        self._undo.callback(setattr, owner, name, original)

    def add(self, owner, name: str, value) -> None:
        """Bind the absent `owner.name` to `value` until the context closes."""
        setattr(owner, name, value)
        self._undo.callback(delattr, owner, name)


def _p1_current_device(patch: _Patcher) -> None:
    # The whole process is CPU-only, so this stand-in cannot hide a GPU.
    patch.replace(torch.cuda, "current_device", lambda: torch.device("cpu"))


def _p3_streams(patch: _Patcher) -> None:
    patch.replace(torch.cuda, "Stream", _CpuStream)
    patch.replace(torch.cuda, "current_stream", lambda device=None: _CPU_STREAM)
    patch.replace(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    patch.replace(torch.cuda, "synchronize", lambda device=None: None)


def _p5_sequence_parallel_torch_norm(patch: _Patcher) -> None:
    # Build the torch norm as without SP, then mark its params as TENorm would.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = patch.get(WrappedTorchNorm, "__new__").__func__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        norm = original_new(cls, _SequenceParallelOff(config), hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    patch.replace(WrappedTorchNorm, "__new__", staticmethod(__new__))


def _p6_process_memory(patch: _Patcher) -> None:
    # Without psutil the async writer dies before reporting, and the save never returns.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL:
        logger.warning("psutil is missing: dist-ckpt writer memory logging reports 0")
        patch.replace(filesystem_async, "_process_memory", lambda: 0)


def _p7_split_sizes_as_numpy(patch: _Patcher) -> None:
    # The dispatcher imported the helper by name, so rebind it in the dispatcher's module.
    from megatron.core.transformer.moe import token_dispatcher

    original = patch.get(token_dispatcher, "maybe_move_tensor_to_cpu")

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    patch.replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _p8_cpu_causal_masks(patch: _Patcher) -> None:
    # fused_softmax imported both helpers by name; run the originals with cuda -> cpu.
    from megatron.core.fusions import fused_softmax

    def on_cpu(fn):
        def wrapper(*args, **kwargs):
            with _CudaToCpuMode():
                return fn(*args, **kwargs)

        return wrapper

    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        patch.replace(fused_softmax, name, on_cpu(patch.get(fused_softmax, name)))


def _p9_clip_grads(patch: _Patcher) -> None:
    # The only CUDA-specific thing in clipping is a type assert; keep its dtype meaning.
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        dtypes = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        grads = []
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                assert grad.dtype in dtypes, f"{attr} dtype {grad.dtype}, expected {dtypes}"
                grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    for module in (clip_grads, megatron_optimizer):
        patch.replace(module, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)


_PATCHES = (
    _p1_current_device,
    _p3_streams,
    _p5_sequence_parallel_torch_norm,
    _p6_process_memory,
    _p7_split_sizes_as_numpy,
    _p8_cpu_causal_masks,
    _p9_clip_grads,
)


def require_cpu_patches(entry: str) -> None:
    """Refuse, in one line, to run the library entry point `entry` on a CPU-only torch outside
    `megatron_on_cpu()` (Megatron-Core would fail deep inside with "Torch not compiled with CUDA
    enabled"). The entry points do not enter the block themselves: the patches are
    process-wide, and a library call that left them applied, or undid them under a caller's
    model, would change Megatron-Core behind the caller's back. The command-line tools enter it.

    Raises:
        RuntimeError: no CUDA and no open `megatron_on_cpu()` block.
    """
    if not torch.cuda.is_available() and _depth == 0:
        raise RuntimeError(
            f"{entry} runs Megatron-Core, which needs CUDA or the CPU patches: on a CPU-only "
            "torch call it inside `with megatron_mea.cpu.megatron_on_cpu():`"
        )


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[bool]:
    """Run the block with Megatron-Core patched for a CPU-only torch; yields whether it is.

    Yields False and patches nothing when CUDA is available. Blocks may nest: only the outermost
    one patches and restores. Enter it before building models (P5 acts at construction time)
    and keep it open while they run (P1, P3 and P7 act in forward). See the module docstring
    for each patch.

    Raises:
        AttributeError: if an attribute a patch replaces is missing (another Megatron-Core).
    """
    global _depth
    if torch.cuda.is_available():
        logger.debug("CUDA is available: Megatron-Core CPU patches not applied")
        yield False
        return
    with contextlib.ExitStack() as undo:
        if _depth == 0:
            from megatron_mea.compat import bind_te_general_gemm_without_te

            bind_te_general_gemm_without_te()
            patcher = _Patcher(undo)
            for patch in _PATCHES:
                patch(patcher)
            logger.debug("Megatron-Core CPU patches applied: %s", [p.__name__ for p in _PATCHES])
        _depth += 1
        try:
            yield True
        finally:
            _depth -= 1
