"""Single-device math of MEA and KHA (no megatron imports); see README.md for the equations."""

from megatron_mea.ops.functional import (
    fold_head_mix,
    fold_kha_linear,
    head_mix,
    head_rms_norm,
    KHA_MATRICES,
    kha_gate,
    kha_init,
    kha_linear,
    kha_mlp,
    kha_transform,
    mix_init,
    rows_with_bias,
    split_bias,
)
from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv

__all__ = [
    "fold_head_mix",
    "fold_kha_linear",
    "fuse_qkv",
    "head_mix",
    "head_rms_norm",
    "KHA_MATRICES",
    "kha_gate",
    "kha_init",
    "kha_linear",
    "kha_mlp",
    "kha_transform",
    "mix_init",
    "rows_with_bias",
    "split_bias",
    "unfuse_qkv",
]
