"""A plain single-device attention layer with MEA / KHA: the fp32 reference the tests compare to.

Everything is explicit: separate Q/K/V projections in torch's `[out, in]` weight convention, the
variant transforms from `functional.py`, rotate-half RoPE, causal softmax attention with GQA, and the
output projection. No megatron import, no parallelism, no fusion.

Shape legend: `s` sequence, `b` batch, `h` hidden, `np` query heads, `nc` component K/V heads,
`ng` K/V groups seen by attention, `hn` head dim.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from megatron_mea.ops.functional import head_mix, head_rms_norm, kha_gate, kha_linear, kha_mlp


@dataclass
class AttentionParams:
    """Weights of one reference attention layer (all optional parts default to "absent").

    Attributes:
        w_q: `[np*hn, h]`; w_k, w_v: `[nc*hn, h]`; w_o: `[h, np*hn]`.
        b_q, b_k, b_v: projection biases or None.
        q_norm, k_norm: RMSNorm scales `[hn]` applied per head (qk_layernorm), or None.
        mix_k, mix_v: MEA HLC matrices `[nc, ng]`, or None (then nc == ng, no mixing).
        head_norm: MEA head RMS norm scale `[np*hn]`, or None.
        key_norm_before_mix: MEA: `k_norm` on the component keys before HLC (norm-then-mix)
            instead of on the composite keys after it.
        kha: KHA matrices `[hn, hn]` by parameter name `{target}_{matrix}`: `q_weight`...
            (linear), `v_up`, `v_gate`, `v_down`... (MLP), or `{target}_gate` alone (gate
            only); each target's variant is read from which names it has.
    """

    w_q: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    w_o: torch.Tensor
    b_q: Optional[torch.Tensor] = None
    b_k: Optional[torch.Tensor] = None
    b_v: Optional[torch.Tensor] = None
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None
    mix_k: Optional[torch.Tensor] = None
    mix_v: Optional[torch.Tensor] = None
    head_norm: Optional[torch.Tensor] = None
    key_norm_before_mix: bool = False
    kha: Dict[str, torch.Tensor] = field(default_factory=dict)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (fp32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, base: float, offset: int = 0) -> torch.Tensor:
    """Rotate-half RoPE (Megatron's default layout) on `x [s, b, heads, hn]`."""
    s, hn = x.shape[0], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn))
    angles = torch.outer(torch.arange(offset, offset + s, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """Causal softmax attention with GQA, queries at the last positions.

    Args:
        q: `[s, b, np, hn]`, query i at position `T - s + i`.
        k, v: `[T, b, ng, hn]`; query head i uses group `i // (np/ng)`.
        scale: softmax scale.

    Returns:
        `[s, b, np, hn]`.
    """
    s, num_heads, num_cached = q.shape[0], q.shape[2], k.shape[0]
    k = k.repeat_interleave(num_heads // k.shape[2], dim=2)
    v = v.repeat_interleave(num_heads // v.shape[2], dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    causal = torch.ones(s, num_cached, dtype=torch.bool).triu(num_cached - s + 1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("bnst,tbnd->sbnd", probs, v)


def attention_ref(
    x: torch.Tensor,
    p: AttentionParams,
    *,
    num_heads: int,
    head_dim: int,
    rope_base: Optional[float] = 10000.0,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Causal self-attention with the MEA / KHA transforms, order as in docs/math.md.

    split -> KHA (q, k, v) -> q_norm | HLC -> k_norm -> RoPE -> softmax attention -> head norm
    -> output projection (k_norm before HLC with `key_norm_before_mix`).

    Args:
        x: input `[s, b, h]` (already layer-normed, as `linear_qkv` sees it).
        p: the layer's weights.
        num_heads: np.
        head_dim: hn.
        rope_base: RoPE base, or None for no position embedding.
        eps: epsilon of the q/k norms and of the head norm.

    Returns:
        `[s, b, h]` (without the output bias).
    """
    s, b, _ = x.shape

    def project(w, bias):
        return torch.nn.functional.linear(x, w, bias).view(s, b, -1, head_dim)

    q, k, v = project(p.w_q, p.b_q), project(p.w_k, p.b_k), project(p.w_v, p.b_v)
    heads = {"q": q, "k": k, "v": v}
    for target in heads:
        if f"{target}_weight" in p.kha:
            heads[target] = kha_linear(heads[target], p.kha[f"{target}_weight"])
        elif f"{target}_up" in p.kha:
            heads[target] = kha_mlp(heads[target], *(p.kha[f"{target}_{m}"]
                                                     for m in ("up", "gate", "down")))
        elif f"{target}_gate" in p.kha:
            heads[target] = kha_gate(heads[target], p.kha[f"{target}_gate"])
    q, k, v = heads["q"], heads["k"], heads["v"]
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, eps)
    if p.k_norm is not None and p.key_norm_before_mix:
        k = rms_norm(k, p.k_norm, eps)
    if p.mix_k is not None:
        k, v = head_mix(k, p.mix_k), head_mix(v, p.mix_v)
    if p.k_norm is not None and not p.key_norm_before_mix:
        k = rms_norm(k, p.k_norm, eps)
    if rope_base is not None:
        q, k = rope(q, rope_base), rope(k, rope_base)

    out = causal_attention(q, k, v, head_dim**-0.5)
    if p.head_norm is not None:
        out = head_rms_norm(out, p.head_norm.view(num_heads, head_dim), eps)
    return torch.nn.functional.linear(out.reshape(s, b, -1), p.w_o)
