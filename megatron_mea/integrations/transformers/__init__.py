"""Hugging Face `transformers` classes for MEA / KHA models (needs the `hf` extra).

Importing this package registers the configs with `AutoConfig` and the models with
`AutoModelForCausalLM` (model types `megatron_mea_<family>`), so that::

    import megatron_mea.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(exported_dir)

works for checkpoints written by `mea-convert export-hf` in the native format.
Exports also carry these two files with an `auto_map`, so `trust_remote_code=True` works
without installing megatron_mea.
"""

try:
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as exc:
    raise ImportError("megatron_mea.integrations.transformers (the Hugging Face models) needs "
                      "transformers (the `hf` extra): pip install 'megatron_mea[hf]'") from exc

from megatron_mea.integrations.transformers.configuration_megatron_mea import CONFIGS
from megatron_mea.integrations.transformers.modeling_megatron_mea import MODELS, VariantAttention

for _model_type, _config in CONFIGS.items():
    AutoConfig.register(_model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, MODELS[_model_type], exist_ok=True)

__all__ = ["CONFIGS", "MODELS", "VariantAttention"]
