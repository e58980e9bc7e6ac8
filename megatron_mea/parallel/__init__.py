"""The only place the plugin's collectives live (see mappings.py)."""

from megatron_mea.parallel.mappings import (
    gather_features,
    heads_to_tokens,
    token_split_sizes,
    tokens_to_heads,
    tp_replicated,
)

__all__ = ["gather_features", "heads_to_tokens", "token_split_sizes", "tokens_to_heads", "tp_replicated"]
