"""The math of MEA and KHA on local heads: the single source both the reference and the layers call.

Shape legend (Megatron's notation): `s` sequence, `b` micro-batch, `nc` component K/V heads,
`ng` composite K/V heads (query groups), `np` query heads, `hn` head dim. Leading dims written `...`
may be anything (`[s, b]`, `[tokens]`, `[tokens, 2]`...). Nothing here imports megatron or knows
about parallelism: the layers hand in already-partitioned heads.

Fed fp32 tensors these functions are the reference; the layers call them in the activation dtype.
Only the RMS norm upcasts (its mean of squares needs fp32, as every Megatron norm does).
"""

import torch

from megatron_mea.variant import KHA_MATRICES


def head_mix(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HLC: composite heads as learned linear combinations of component heads.

    `out[..., h, :] = sum_j x[..., j, :] * weight[..., j, h]`.

    Args:
        x: component heads `[..., nc, hn]`.
        weight: mixing matrix `[nc, ng]`, or a stack `[..., nc, ng]` whose leading dims broadcast
            against those of `x` (K and V mixed in one call: `x [tokens, 2, nc, hn]`,
            `weight [2, nc, ng]`).

    Returns:
        composite heads `[..., ng, hn]`.
    """
    return torch.einsum("...jd,...jh->...hd", x, weight)


def rows_with_bias(weight: torch.Tensor, bias) -> torch.Tensor:
    """Projection rows `[out, in]` with the bias appended as a last column (`[out, in + 1]`),
    so that a fold of the rows folds the bias alike; `bias` may be None (rows returned as is)."""
    return weight if bias is None else torch.cat([weight, bias.unsqueeze(1)], dim=1)


def split_bias(rows: torch.Tensor, has_bias: bool):
    """Inverse of `rows_with_bias`: `(weight, bias or None)`."""
    return (rows[:, :-1], rows[:, -1]) if has_bias else (rows, None)


def fold_head_mix(component: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """HLC folded into projection rows: `W_h = sum_j A[j, h] W_j` (torch's `[out, in]` rows).

    Projecting with the folded rows equals projecting with the component rows and then mixing
    (`head_mix`), since both are linear; the `weights` TP exchange and the converters use this.

    Args:
        component: `[nc, hn, ...]` K (or V) weight (or bias) rows per component head.
        mix: `A [nc, ng]`.

    Returns:
        `[ng, hn, ...]`.
    """
    return torch.einsum("jd...,jh->hd...", component, mix)


def fold_kha_linear(heads: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """KHA-Linear folded into projection rows: `W_h' = T^T W_h` (bias: `b_h @ T`).

    Projecting with the folded rows equals projecting and then applying `kha_linear`.

    Args:
        heads: `[heads, hn, ...]` weight or bias rows (torch's `[out, in]` convention).
        transform: `T [hn, hn]`.
    """
    return torch.einsum("ed,ne...->nd...", transform, heads)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Head-level group norm: RMS-normalise every head over its own `hn` channels, then scale.

    Args:
        x: attention output `[..., np, hn]`.
        weight: per-head, per-channel scale `[np, hn]`.
        eps: added to the mean of squares.

    Returns:
        `[..., np, hn]` in `x.dtype`; computed in fp32 (or wider).
    """
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    inv_rms = torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (wide * inv_rms * weight.to(wide.dtype)).to(x.dtype)


def kha_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """KHA-Linear: the same `hn x hn` matrix applied to every head along the feature axis.

    Args:
        x: heads `[..., heads, hn]`.
        weight: `T [hn, hn]`, in the papers' `x @ T` convention (identity at init).

    Returns:
        `x @ T`, `[..., heads, hn]`.
    """
    return torch.matmul(x, weight)


def kha_mlp(
    x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """KHA-MLP (values only): `2 * ((x @ W_up) * sigmoid(x @ W_gate)) @ W_down`.

    The factor 2 makes the module exactly the identity at its init (`W_up = W_down = I`,
    `W_gate = 0`, so the gate is 1/2 everywhere).

    Args:
        x: value heads `[..., heads, hn]`.
        up, gate, down: `[hn, hn]` each.

    Returns:
        `[..., heads, hn]`.
    """
    return 2 * torch.matmul(torch.matmul(x, up) * torch.sigmoid(torch.matmul(x, gate)), down)


def kha_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """KHA gate only (the KHA paper's gate-only ablation): `2 * x * sigmoid(x @ W_gate)`, the
    MLP of `kha_mlp` without its up and down projections (identity at `W_gate = 0`).

    Args:
        x: heads `[..., heads, hn]`.
        gate: `[hn, hn]`.

    Returns:
        `[..., heads, hn]`.
    """
    return 2 * x * torch.sigmoid(torch.matmul(x, gate))


def kha_transform(x: torch.Tensor, variant: str, *matrices: torch.Tensor) -> torch.Tensor:
    """The KHA transform `variant` (`linear`, `mlp`, `gate`) of heads `x [..., heads, hn]`,
    with the target's matrices in `KHA_MATRICES[variant]` order."""
    if variant == "linear":
        return kha_linear(x, *matrices)
    if variant == "mlp":
        return kha_mlp(x, *matrices)
    if variant == "gate":
        return kha_gate(x, *matrices)
    raise ValueError(f"unknown KHA variant {variant!r}")


def kha_init(variant: str, head_dim: int, kind: str = "identity") -> dict:
    """Initial matrices of one KHA target in fp32, `{suffix: [hn, hn]}` (`KHA_MATRICES` order).

    Args:
        variant: `linear`, `mlp` or `gate`.
        head_dim: hn.
        kind: `identity` (identity matrices, zero gate: the transform is the identity) or
            `random` (every matrix from N(0, 1/hn), drawn from the default torch generator).
    """
    if kind == "random":
        return {name: torch.randn(head_dim, head_dim) / head_dim**0.5
                for name in KHA_MATRICES[variant]}
    if kind != "identity":
        raise ValueError(f"unknown KHA init {kind!r}")
    return {name: torch.zeros(head_dim, head_dim) if name == "gate" else torch.eye(head_dim)
            for name in KHA_MATRICES[variant]}


def mix_init(kind: str, num_components: int, num_groups: int) -> torch.Tensor:
    """Initial HLC matrix `[nc, ng]` in fp32 (`normal` draws from the default torch generator).

    Args:
        kind: `identity` (needs nc == ng), `repeat` (composite h copies component h*nc//ng, i.e.
            exactly GQA with nc groups) or `normal` (std 1/sqrt(nc)).
        num_components: nc.
        num_groups: ng.
    """
    if kind == "identity":
        if num_components != num_groups:
            raise ValueError(f"identity mixing needs nc == ng, got {num_components}, {num_groups}")
        return torch.eye(num_components)
    if kind == "repeat":
        weight = torch.zeros(num_components, num_groups)
        composite = torch.arange(num_groups)
        weight[composite * num_components // num_groups, composite] = 1.0
        return weight
    if kind == "normal":
        return torch.randn(num_components, num_groups) / num_components**0.5
    raise ValueError(f"unknown mix init {kind!r}")
