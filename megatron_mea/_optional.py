"""The one door for optional dependencies: the CUDA-only ones (Transformer Engine, NVIDIA Apex)
and the applications' pip extras.

Probing uses `find_spec`, so importing megatron_mea never imports them. A feature that needs a
CUDA-only one calls `require(...)` at construction time; an application that needs a package of
an extra imports it with `import_extra(...)`. Either way a missing one is an `ImportError`
naming what to install.
"""

import importlib
from importlib.util import find_spec

HAVE_TE = find_spec("transformer_engine") is not None
# NVIDIA Apex installs the `apex` package with `apex.normalization`; the unrelated PyPI project of
# the same name does not have that submodule, so probe for it rather than for `apex`.
HAVE_APEX = find_spec("apex") is not None and find_spec("apex.normalization") is not None
# Apex's persistent LayerNorm kernel (what Megatron's `persist_layer_norm` selects).
HAVE_APEX_PERSIST_LAYER_NORM = HAVE_APEX and find_spec("apex.contrib.layer_norm") is not None
# The fused softmax kernels of Megatron's `FusedScaleMaskSoftmax` (`masked_softmax_fusion`):
# top-level extension modules built by Apex (or by Megatron-LM's own fused_kernels).
HAVE_FUSED_SOFTMAX = all(
    find_spec(name) is not None
    for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                 "scaled_softmax_cuda")
)

_EXTRAS = {
    "transformer_engine": ("Transformer Engine", "pip install 'megatron_mea[te]'"),
    "apex": ("NVIDIA Apex", "build it from github.com/NVIDIA/apex (not the PyPI package 'apex')"),
}


def require(dependency: str, feature: str) -> None:
    """Raise ImportError naming `feature` and how to install `dependency` if it is missing.

    Args:
        dependency: `transformer_engine` or `apex`.
        feature: what the user asked for, e.g. "use_transformer_engine=True".
    """
    present = {"transformer_engine": HAVE_TE, "apex": HAVE_APEX}[dependency]
    if not present:
        name, how = _EXTRAS[dependency]
        raise ImportError(f"{feature} needs {name}, which is not installed: {how}")


def transformer_engine_class(name: str):
    """`transformer_engine.pytorch.<name>` (a class, for `isinstance` checks), or None without
    Transformer Engine. Imports it only when installed: by then Megatron-Core has imported it."""
    if not HAVE_TE:
        return None
    return getattr(importlib.import_module("transformer_engine.pytorch"), name)


# The packages of the applications' extras (pyproject.toml): the library needs none of them.
# `tools`: what the command-line tools add (progress bars, TensorBoard, plots, GPU telemetry).
EXTRA_OF = {
    "tqdm": "tools",
    "torch.utils.tensorboard": "tools",
    "matplotlib": "tools",
    "matplotlib.pyplot": "tools",
    "transformers": "hf",
    "safetensors": "hf",
    "lm_eval": "eval",
    # Triton comes with CUDA builds of torch and with vLLM; the paged kernel serves vLLM.
    "triton": "vllm",
    "triton.language": "vllm",
}


def import_extra(module: str, feature: str):
    """Import `module` (a package of an extra, `EXTRA_OF`) for `feature`.

    Raises:
        ImportError: naming the feature, the package and the extra that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRA_OF[module]
        raise ImportError(
            f"{feature} needs {module.split('.')[0]} (the `{extra}` extra): "
            f"pip install 'megatron_mea[{extra}]'"
        ) from exc
