"""Megatron modules of the MEA and KHA variants."""

from megatron_mea.layers.attention import KHASelfAttention
from megatron_mea.layers.fold_cache import (
    FoldCache,
    enable_fold_cache,
    flush_fold_caches,
    with_fold_flush,
)
from megatron_mea.layers.head_mix import HeadMix
from megatron_mea.layers.head_norm import HeadNormedInput, HeadRMSNorm, head_normed
from megatron_mea.layers.knock import KnockingHeads
from megatron_mea.layers.kv_cache import MEAKVCache
from megatron_mea.layers.mea_attention import MEASelfAttention

__all__ = [
    "FoldCache",
    "HeadMix",
    "HeadNormedInput",
    "HeadRMSNorm",
    "KHASelfAttention",
    "KnockingHeads",
    "MEAKVCache",
    "MEASelfAttention",
    "enable_fold_cache",
    "flush_fold_caches",
    "head_normed",
    "with_fold_flush",
]
