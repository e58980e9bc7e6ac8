"""Megatron's interleaved QKV layout, the one place it is written down.

`linear_qkv` produces, and its weight (and bias) stores, per K/V group `q_1 .. q_{np/ng} k v`
(`hn` each): `ng * (np/ng + 2) * hn` entries along one dim, the rows of the weight (`dim=0`)
or the features of the activations (`dim=-1`). The layers split activations with it, the folds
rewrite weight rows with it, and the converters translate to and from separate q/k/v tensors.

Shape legend: `np` query heads, `ng` K/V groups (MEA: component heads), `hn` head dim; `...`
the other dims, kept in place.
"""

import torch


def unfuse_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int, dim: int = 0
):
    """Split the interleaved dim `dim` into separate heads.

    Args:
        fused: `[..., ng*(np/ng+2)*hn, ...]` (e.g. weight rows `[rows, h]` with dim=0, or
            `linear_qkv`'s output `[s, b, features]` with dim=-1).
        num_heads, num_groups, head_dim: np, ng, hn (local counts for a TP shard).
        dim: the interleaved dim.

    Returns:
        q `[..., np, hn, ...]`, k and v `[..., ng, hn, ...]` in place of `dim`; k and v are
        views, q is a view when `np == ng`.
    """
    dim = dim % fused.dim()
    per_group = num_heads // num_groups
    lead, rest = fused.shape[:dim], fused.shape[dim + 1 :]
    grouped = fused.reshape(*lead, num_groups, per_group + 2, head_dim, *rest)
    # One split, not narrow + select: autograd then joins the three gradients with one cat,
    # where narrow/select would each scatter into a zero-filled tensor of the full size and
    # sum the three (four full-size passes more per call).
    q, k, v = torch.split(grouped, [per_group, 1, 1], dim=dim + 1)
    q = q.reshape(*lead, num_heads, head_dim, *rest)
    return q, k.squeeze(dim + 1), v.squeeze(dim + 1)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of `unfuse_qkv`: the heads at `dim` (and `dim + 1` the head dim) become one
    interleaved dim; the number of groups is `k.shape[dim]`.

    Args:
        q: `[..., np, hn, ...]`; k, v: `[..., ng, hn, ...]`.
        dim: where the head axis sits (as `unfuse_qkv`'s `dim`).

    Returns:
        `[..., ng*(np/ng+2)*hn, ...]`.
    """
    dim = dim % k.dim()
    num_heads, num_groups = q.shape[dim], k.shape[dim]
    lead, head_dim, rest = q.shape[:dim], q.shape[dim + 1], q.shape[dim + 2 :]
    q = q.reshape(*lead, num_groups, num_heads // num_groups, head_dim, *rest)
    grouped = torch.cat([q, k.unsqueeze(dim + 1), v.unsqueeze(dim + 1)], dim=dim + 1)
    return grouped.reshape(*lead, -1, *rest)
