"""Megatron's fused `linear_qkv` weight layout, as pure functions on tensors.

`linear_qkv.weight` is `[ng * (np/ng + 2) * hn, h]`, grouped per K/V group as
`q_1 .. q_{np/ng} k v`. These helpers convert between that and separate per-head tensors
`q [np, hn, ...]`, `k, v [ng, hn, ...]` (trailing dims: `h` for weights, none for biases).
"""

import torch


def unfuse_qkv(fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """`[ng*(np/ng+2)*hn, ...]` -> q `[np, hn, ...]`, k `[ng, hn, ...]`, v `[ng, hn, ...]`."""
    per_group = num_heads // num_groups
    rest = fused.shape[1:]
    grouped = fused.reshape(num_groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(num_heads, head_dim, *rest)
    return q, grouped[:, per_group], grouped[:, per_group + 1]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Inverse of `unfuse_qkv`: the number of groups is `k.shape[0]`."""
    num_heads, num_groups = q.shape[0], k.shape[0]
    head_dim, rest = q.shape[1], q.shape[2:]
    q = q.reshape(num_groups, num_heads // num_groups, head_dim, *rest)
    grouped = torch.cat([q, k.unsqueeze(1), v.unsqueeze(1)], dim=1)
    return grouped.reshape(-1, *rest)
