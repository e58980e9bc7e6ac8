"""Checkpoint-format helpers: pure functions on tensors (no parallel state)."""

from megatron_mea.checkpoint.fold import fold_head_mix, fold_kha_linear
from megatron_mea.checkpoint.qkv_layout import fuse_qkv, unfuse_qkv

__all__ = ["fold_head_mix", "fold_kha_linear", "fuse_qkv", "unfuse_qkv"]
