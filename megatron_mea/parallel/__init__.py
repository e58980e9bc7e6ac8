"""The only place the plugin's collectives live (see mappings.py)."""

from megatron_mea.parallel.mappings import (
    heads_to_tokens,
    token_split_sizes,
    tokens_to_heads,
    tp_replicated,
)

__all__ = ["heads_to_tokens", "token_split_sizes", "tokens_to_heads", "tp_replicated"]
