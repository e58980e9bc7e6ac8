"""Fold linear MEA / KHA transforms into plain Q/K/V projection weights.

HLC without the head norm and KHA-Linear are linear maps applied right after the projection
(before any norm or RoPE), so a plain attention whose projection already includes them computes
the same function. Weights use torch's `[out, in]` convention, per head: `[heads, hn, h]`.
"""

import torch

from megatron_mea.ops.functional import fold_head_mix  # noqa: F401  (re-exported)


def fold_kha_linear(heads: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """Projection rows that already apply `x @ T` per head: `W_h' = T^T W_h` (bias: `b_h @ T`).

    Args:
        heads: `[heads, hn, ...]` weight or bias.
        transform: `T [hn, hn]`.
    """
    return torch.einsum("ed,ne...->nd...", transform, heads)
