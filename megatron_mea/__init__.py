"""megatron_mea: MEA (Multi-head Explicit Attention) and KHA (Knocking-Heads Attention) for
Megatron-Core.

Public surface (SPEC section 5)::

    from megatron_mea import MEATransformerConfig, get_gpt_layer_spec, get_gpt_decoder_block_spec

Importing this package needs megatron-core and torch only: no Transformer Engine, Apex or GPU.
"""

__version__ = "0.1.0"

from megatron_mea.config import MEATransformerConfig
from megatron_mea.specs import apply_attention_variant, get_gpt_decoder_block_spec, get_gpt_layer_spec

__all__ = [
    "MEATransformerConfig",
    "__version__",
    "apply_attention_variant",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_spec",
]
