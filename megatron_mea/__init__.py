"""megatron_mea: MEA (Multi-head Explicit Attention) and KHA (Knocking-Heads Attention) for
Megatron-Core.

Public surface::

    from megatron_mea import MEATransformerConfig, get_gpt_layer_spec, get_gpt_decoder_block_spec

Importing this package needs megatron-core and torch only: no Transformer Engine, Apex or GPU.
"""

import importlib

__version__ = "0.1.0"

# Public name -> the module defining it. They import Megatron-Core, so they load on first use:
# `import megatron_mea.cli` must run before Megatron's import-time warnings to filter them.
_EXPORTS = {
    "MEATransformerConfig": "megatron_mea.config",
    "apply_attention_variant": "megatron_mea.specs",
    "get_gpt_decoder_block_spec": "megatron_mea.specs",
    "get_gpt_layer_spec": "megatron_mea.specs",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
