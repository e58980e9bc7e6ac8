"""Megatron modules of the MEA and KHA variants."""

from megatron_mea.layers.attention import KHASelfAttention, MEASelfAttention, split_qkv
from megatron_mea.layers.head_mix import HeadMix
from megatron_mea.layers.head_norm import HeadRMSNorm
from megatron_mea.layers.knock import KnockingHeads

__all__ = [
    "HeadMix",
    "HeadRMSNorm",
    "KHASelfAttention",
    "KnockingHeads",
    "MEASelfAttention",
    "split_qkv",
]
