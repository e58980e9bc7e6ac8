"""Megatron modules of the MEA and KHA variants."""

from megatron_mea.layers.attention import KHASelfAttention, KHASelfAttentionSubmodules
from megatron_mea.layers.fold_cache import (
    FoldCache,
    enable_fold_cache,
    flush_fold_caches,
    with_fold_flush,
)
from megatron_mea.layers.head_mix import HeadMix
from megatron_mea.layers.head_norm import (
    HeadNormedInput,
    HeadNormedRowParallelLinear,
    HeadRMSNorm,
    head_normed_projection,
)
from megatron_mea.layers.knock import KnockingHeads
from megatron_mea.layers.kv_cache import MEAKVCache
from megatron_mea.layers.mea_attention import MEASelfAttention, MEASelfAttentionSubmodules

__all__ = [
    "FoldCache",
    "HeadMix",
    "HeadNormedInput",
    "HeadNormedRowParallelLinear",
    "HeadRMSNorm",
    "KHASelfAttention",
    "KHASelfAttentionSubmodules",
    "KnockingHeads",
    "MEAKVCache",
    "MEASelfAttention",
    "MEASelfAttentionSubmodules",
    "enable_fold_cache",
    "flush_fold_caches",
    "head_normed_projection",
    "with_fold_flush",
]
