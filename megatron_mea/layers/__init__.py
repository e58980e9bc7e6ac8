"""Megatron modules of the MEA and KHA variants."""

from megatron_mea.layers.attention import KHASelfAttention, MEASelfAttention, split_qkv
from megatron_mea.layers.fold_cache import (
    FoldCache,
    enable_fold_cache,
    flush_fold_caches,
    with_fold_flush,
)
from megatron_mea.layers.head_mix import HeadMix
from megatron_mea.layers.head_norm import HeadRMSNorm
from megatron_mea.layers.knock import KnockingHeads

__all__ = [
    "FoldCache",
    "HeadMix",
    "HeadRMSNorm",
    "KHASelfAttention",
    "KnockingHeads",
    "MEASelfAttention",
    "enable_fold_cache",
    "flush_fold_caches",
    "split_qkv",
    "with_fold_flush",
]
