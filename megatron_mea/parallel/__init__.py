"""The only place the plugin's collectives live (mappings.py), and their volumes (exchange.py)."""

from megatron_mea.parallel.exchange import (
    ExchangeShape,
    activation_exchange_elements,
    choose_exchange,
    weight_exchange_elements,
)
from megatron_mea.parallel.mappings import (
    gather_features,
    gather_rows,
    heads_to_tokens,
    token_split_sizes,
    tokens_to_heads,
    tp_replicated,
)

__all__ = [
    "ExchangeShape",
    "activation_exchange_elements",
    "choose_exchange",
    "gather_features",
    "gather_rows",
    "heads_to_tokens",
    "token_split_sizes",
    "tokens_to_heads",
    "tp_replicated",
    "weight_exchange_elements",
]
