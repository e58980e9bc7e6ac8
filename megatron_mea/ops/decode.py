"""Attention of new tokens over a KV cache, straight from MEA's component heads (no megatron).

A composite key is `k_g = r_g * (w * sum_c A_k[c, g] k_c)` before RoPE: HLC, then the k norm,
which for an RMS-type norm is one scalar `r_g` (the inverse RMS of the mixed key) times an
elementwise scale `w` shared by every head. `w` commutes with the mix (both are linear, one acts
on channels, the other on heads) and so does RoPE (linear per position, identical for every
head), so with cached entries `K_c = RoPE(w * k_c)` and `r_g` per token:

    q_h . RoPE(k_g) = r_g * sum_c A_k[c, g] (q_h . K_c)       (g the group of query head h)
    sum_t p_h(t) v_g(t) = sum_c A_v[c, g] (p_h @ V_c)

The mix moves to the query side (`A_k[c, g] q_h`, one `[np, nc*hn]` matrix) and to the outputs;
the per-step cost is the attention over `nc` cached heads and nothing else proportional to the
prefix. `key_scales` carries `r_g` (absent without a k norm: `r = 1`).

Shape legend: `b` batch, `s` new tokens (positions `T-s .. T-1`), `T` cached positions (the new
ones included), `np` query heads, `ng` composite groups, `nc` component heads, `hn` head dim.
Caches are token-major, `[b, T, heads, hn]` (views of Megatron's `[T, B, ...]` buffers; for
components the mixed axis `nc*hn` is the inner dim of one GEMM); `key_scales [b, ng, T]`.
"""

import enum
from typing import Literal, Optional

import torch


class CacheKind(enum.Enum):
    """What an MEA layer caches per token (Megatron's decoder, `layers/kv_cache.py`, and the vLLM
    plugin, `integrations/vllm/`, choose it with `choose`)."""

    COMPOSITES = "composites"
    COMPONENTS = "components"
    SCALED_COMPONENTS = "scaled components"

    @property
    def holds_components(self) -> bool:
        return self is not CacheKind.COMPOSITES

    @classmethod
    def choose(cls, num_components: int, num_groups: int,
               key_norm: Literal[None, "rms", "other"]) -> "CacheKind":
        """The kind for `nc` components, `ng` composite heads and a k norm that is absent (None),
        RMS-type (`"rms"`: a scale times one scalar per head) or anything else (`"other"`)."""
        if num_components == num_groups:
            return cls.COMPOSITES  # components would save nothing and cost more per step
        if key_norm is None:
            return cls.COMPONENTS
        # A norm with a mean or a bias (LayerNorm) does not factor out of the mix.
        return cls.SCALED_COMPONENTS if key_norm == "rms" else cls.COMPOSITES


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`1 / sqrt(mean(x^2) + eps)` over the last dim, in fp32: `[..., hn]` -> `[...]`."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(wide.square().mean(dim=-1) + eps)


def per_head(mix: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The mixing column of each query head's group: `A [nc, ng]` -> `[nc, np]` (GQA order:
    heads `g*np/ng .. (g+1)*np/ng - 1` belong to group g)."""
    return mix.repeat_interleave(num_heads // mix.shape[1], dim=1)


def decode_mask(num_new: int, num_cached: int, device=None) -> Optional[torch.Tensor]:
    """Causal mask of `s` new tokens over `T` cached positions, `[s, T]` bool, True = masked
    (new token i sits at position `T - s + i`); None for a single token (it sees everything)."""
    if num_new == 1:
        return None
    offset = num_cached - num_new
    return torch.ones(num_new, num_cached, dtype=torch.bool, device=device).triu(offset + 1)


def component_scores(query: torch.Tensor, keys: torch.Tensor, head_mix: torch.Tensor):
    """Raw scores of query heads over component keys: `sum_c head_mix[c, h] (q_h . K_c(t))`.

    Args:
        query: `[b, s, np, hn]` (RoPE'd).
        keys: component cache `[b, T, nc, hn]` (RoPE'd, k-norm scale applied).
        head_mix: `[nc, np]` (`per_head(A_k)`; under TP a rank's rows of it).

    Returns:
        `[b, np, s, T]`.
    """
    b, s, num_heads, hn = query.shape
    num_cached, nc = keys.shape[1], keys.shape[2]
    mixed = torch.einsum("bshd,ch->bhscd", query, head_mix.to(query.dtype))
    flat_keys = keys.reshape(b, num_cached, nc * hn)  # a view of a cache slice
    scores = torch.matmul(mixed.reshape(b, num_heads * s, nc * hn), flat_keys.transpose(1, 2))
    return scores.view(b, num_heads, s, num_cached)


def component_values(probs: torch.Tensor, values: torch.Tensor, head_mix: torch.Tensor):
    """Outputs from component values: `o_h = sum_c head_mix[c, h] (p_h @ V_c)`.

    Args:
        probs: `[b, np, s, T]`.
        values: component cache `[b, T, nc, hn]`.
        head_mix: `[nc, np]` (`per_head(A_v)`).

    Returns:
        `[b, s, np, hn]`.
    """
    b, num_heads, s, num_cached = probs.shape
    nc, hn = values.shape[2], values.shape[3]
    out = torch.matmul(
        probs.reshape(b, num_heads * s, num_cached), values.reshape(b, num_cached, nc * hn)
    )
    out = out.view(b, num_heads, s, nc, hn)
    return torch.einsum("bhscd,ch->bshd", out, head_mix.to(out.dtype))


def softmax_scores(
    scores: torch.Tensor,
    scale: float,
    key_scales: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention probabilities from raw scores, softmax in fp32.

    Args:
        scores: `[b, np, s, T]`.
        scale: the softmax scale (`1/sqrt(hn)` by default).
        key_scales: `[b, ng, T]` inverse RMS of each composite key, or None.
        mask: bool, True = masked, broadcastable to `[b, np, s, T]`, or None.

    Returns:
        `[b, np, s, T]` in `scores.dtype`.
    """
    wide = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if key_scales is not None:
        b, num_heads, s, num_cached = wide.shape
        groups = key_scales.shape[1]
        wide = wide.view(b, groups, num_heads // groups, s, num_cached)
        wide = (wide * key_scales[:, :, None, None, :]).view(b, num_heads, s, num_cached)
    if mask is not None:
        wide = wide.masked_fill(mask, float("-inf"))
    return wide.softmax(dim=-1).to(scores.dtype)


def component_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_mix: torch.Tensor,
    value_mix: torch.Tensor,
    scale: float,
    key_scales: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of `query` over a component cache holding every component (one device).

    Args:
        query: `[b, s, np, hn]`, RoPE'd.
        keys, values: `[b, T, nc, hn]` (keys RoPE'd after the k-norm scale).
        key_mix, value_mix: `A_k`, `A_v` `[nc, ng]` (the columns of this rank's groups).
        scale: softmax scale.
        key_scales: `[b, ng, T]`, or None without a k norm.
        mask: True = masked, broadcastable to `[b, np, s, T]`; None = no mask.

    Returns:
        `[b, s, np, hn]`.
    """
    num_heads = query.shape[2]
    scores = component_scores(query, keys, per_head(key_mix, num_heads))
    probs = softmax_scores(scores, scale, key_scales, mask)
    return component_values(probs, values, per_head(value_mix, num_heads))


def grouped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain GQA attention over a cache of (composite) heads.

    Args:
        query: `[b, s, np, hn]`, RoPE'd.
        keys, values: `[b, T, ng, hn]`, keys RoPE'd and normed.
        scale: softmax scale.
        mask: True = masked, broadcastable to `[b, np, s, T]`; None = no mask.

    Returns:
        `[b, s, np, hn]`.
    """
    b, s, num_heads, hn = query.shape
    num_cached, groups = keys.shape[1], keys.shape[2]
    per_group = num_heads // groups
    # [b, ng, (np/ng)*s, hn]: every head of a group against that group's keys in one GEMM.
    grouped = query.reshape(b, s, groups, per_group, hn).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(b, groups, per_group * s, hn)
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)).view(b, num_heads, s, num_cached)
    probs = softmax_scores(scores, scale, None, mask)
    out = torch.matmul(probs.view(b, groups, per_group * s, num_cached), values.transpose(1, 2))
    return out.view(b, groups, per_group, s, hn).permute(0, 3, 1, 2, 4).reshape(b, s, num_heads, hn)
