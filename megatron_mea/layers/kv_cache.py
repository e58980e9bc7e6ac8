"""MEA's KV cache in Megatron's static inference context, and the attention over it.

Each MEA layer keeps Megatron's pair `context.key_value_memory_dict[layer_number] =
(keys, values)`, sequence-major with the batch at dim 1 and the keys `[T, B, heads, hn]` as
Megatron's own buffers (so `StaticInferenceContext.swap_key_value_dict` still reorders them and
the key shape still says how many heads are cached), in one of three kinds (`CacheKind`):

- `COMPONENTS` (`nc < ng`, no k norm): this rank's component keys `RoPE(k_c)` and values.
  Attention mixes on the query side (`ops/decode.py`).
- `SCALED_COMPONENTS` (`nc < ng`, an RMS-type k norm): component keys `RoPE(w * k_c)` (`w` the
  k-norm scale) and values, each token's values followed by the inverse RMS `r_g` of each of
  this rank's composite keys (`ng_loc` scalars in the cache dtype; they ride with the values
  because Megatron's entry is a pair).
- `COMPOSITES` (`nc == ng`, where components save nothing, or a k norm that is not RMS-type):
  the composite keys after the k norm and RoPE, and the composite values, as plain GQA.

Shape legend: `T` the context's max sequence length, `B` its max batch, `s` new tokens, `b` the
batch slice, `n` cached heads (`nc_loc`, all `nc` when duplicated, or `ng_loc`), `hn` head dim.
"""

import dataclasses
from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region
from megatron.core.transformer.torch_norm import L2Norm

from megatron_mea._optional import transformer_engine_class
from megatron_mea.ops.decode import (  # noqa: F401  (CacheKind: this module's kinds)
    CacheKind,
    component_attention,
    component_scores,
    component_values,
    grouped_attention,
    per_head,
    softmax_scores,
)
from megatron_mea.parallel import gather_rows


@dataclasses.dataclass(frozen=True)
class RMSFactors:
    """An RMS-type norm `x * rsqrt(mean(x^2) + eps) * scale` per head, split into its factors.

    Attributes:
        scale: `[hn]`, or None for 1 (`L2Norm`).
        eps: added to the mean square; None for torch's default, the input dtype's epsilon.
    """

    scale: Optional[torch.Tensor]
    eps: Optional[float]

    def eps_for(self, dtype: torch.dtype) -> float:
        return torch.finfo(dtype).eps if self.eps is None else self.eps


def rms_factors(norm: torch.nn.Module) -> Optional[RMSFactors]:
    """The factors of the k norm `norm` (a module, not None or Megatron's `IdentityOp`: no norm
    needs no factoring), or None when it is not RMS-type (a LayerNorm's mean and bias do not
    factor out of the mix)."""
    if isinstance(norm, torch.nn.RMSNorm):
        return RMSFactors(norm.weight, norm.eps)
    if isinstance(norm, L2Norm):
        return RMSFactors(None, norm.eps)
    te_rms_norm = transformer_engine_class("RMSNorm")
    if te_rms_norm is not None and isinstance(norm, te_rms_norm):
        # Megatron's TENorm builds this; zero-centred gamma stores w - 1.
        offset = 1.0 if getattr(norm, "zero_centered_gamma", False) else 0.0
        return RMSFactors(norm.weight + offset, norm.eps)
    return None


class MEAKVCache:
    """One MEA layer's cache buffers (see the module docstring for the kinds).

    Attributes:
        kind: a `CacheKind`.
        keys: `[T, B, n, hn]`.
        values: `[T, B, n, hn]`, or `[T, B, n*hn + ng_loc]` (`SCALED_COMPONENTS`: the values,
            then the key scales).
    """

    def __init__(self, kind: CacheKind, keys: torch.Tensor, values: torch.Tensor):
        self.kind, self.keys, self.values = kind, keys, values
        self.width = keys.shape[2] * keys.shape[3]  # n*hn: where the key scales start

    @classmethod
    def of(cls, context, layer_number, kind, num_heads, head_dim, num_scales, like):
        """The layer's cache in `context`, allocated on first use.

        Args:
            context: a `StaticInferenceContext`.
            layer_number: the layer's (1-based) number, the dict key.
            kind: a `CacheKind`.
            num_heads: n, cached heads on this rank.
            head_dim: hn.
            num_scales: key scales per token (`ng_loc`; used by `SCALED_COMPONENTS` only).
            like: a tensor of the cache's dtype and device.
        """
        entry = context.key_value_memory_dict.get(layer_number)
        if entry is None:
            shape = (context.max_sequence_length, context.max_batch_size, num_heads, head_dim)
            value_shape = shape
            if kind is CacheKind.SCALED_COMPONENTS:
                value_shape = (*shape[:2], num_heads * head_dim + num_scales)
            entry = (like.new_empty(shape), like.new_empty(value_shape))
            context.key_value_memory_dict[layer_number] = entry
        return cls(kind, *entry)

    def write(self, start, batch, keys, values, key_scales=None) -> None:
        """Store `s` new tokens at positions `[start, start + s)` of the rows `batch`.

        Args:
            keys, values: `[s, b, n, hn]`.
            key_scales: `[s, b, ng_loc]` for `SCALED_COMPONENTS`, else None.
        """
        if (key_scales is not None) != (self.kind is CacheKind.SCALED_COMPONENTS):
            raise ValueError(f"a {self.kind.value} cache takes key scales only when scaled")
        positions = slice(start, start + keys.shape[0])
        self.keys[positions, batch] = keys
        if key_scales is None:
            self.values[positions, batch] = values
        else:
            self.values[positions, batch, : self.width] = values.flatten(2)
            self.values[positions, batch, self.width :] = key_scales

    def read(self, end, batch):
        """Views of positions `[0, end)`: keys, values `[b, end, n, hn]` and the key scales
        `[b, end, ng_loc]` (None unless `SCALED_COMPONENTS`)."""
        keys, values = self.keys[:end, batch], self.values[:end, batch]
        scales = None
        if self.kind is CacheKind.SCALED_COMPONENTS:
            scales = values[..., self.width :].transpose(0, 1)
            values = values[..., : self.width].view(keys.shape)
        return keys.transpose(0, 1), values.transpose(0, 1), scales


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """The new tokens of one decode step, as `attend` takes them.

    Attributes:
        query: `[b, s, np_loc, hn]`, RoPE'd.
        end: the new tokens end at position `end`: they attend to cached positions `[0, end)`.
        batch: the cache's batch rows.
        mask: True = masked, broadcastable to `[b, np_loc, s, end]`, or None.
        scale: the softmax scale.
    """

    query: torch.Tensor
    end: int
    batch: slice
    mask: Optional[torch.Tensor]
    scale: float


@dataclasses.dataclass(frozen=True)
class QuerySideMix:
    """HLC moved to the query side, for a cache of components.

    Attributes:
        key_mix, value_mix: `A_k`, `A_v` `[nc, ng]` (whole, not sharded).
        tp_group: the tensor-parallel group.
        sharded: components split over the TP ranks (`nc >= t > 1`): each rank scores all heads
            against its components and the partial sums meet in reduce-scatters. Otherwise
            every rank holds every component and attends with its own composite groups.
    """

    key_mix: torch.Tensor
    value_mix: torch.Tensor
    tp_group: torch.distributed.ProcessGroup
    sharded: bool


def attend(cache: MEAKVCache, step: DecodeStep, mix: Optional[QuerySideMix]) -> torch.Tensor:
    """Attention of `step`'s queries over the cache: grouped attention over composites, or over
    components with `mix` (None only for a cache of composites).

    Returns:
        `[b, s, np_loc, hn]`.
    """
    keys, values, key_scales = cache.read(step.end, step.batch)
    if cache.kind is CacheKind.COMPOSITES:
        return grouped_attention(step.query, keys, values, step.scale, step.mask)
    if key_scales is not None:
        key_scales = key_scales.transpose(1, 2)  # [b, ng_loc, end]
    if mix.sharded:
        return _sharded_component_attention(step, keys, values, key_scales, mix)
    world, rank = mix.tp_group.size(), mix.tp_group.rank()
    groups = mix.key_mix.shape[1] // world
    local = slice(rank * groups, (rank + 1) * groups)  # this rank's composite groups
    return component_attention(
        step.query, keys, values, mix.key_mix[:, local], mix.value_mix[:, local], step.scale,
        key_scales, step.mask,
    )


def _heads_first(x, head_dim):
    return x.movedim(head_dim, 0).contiguous()


def _sharded_component_attention(step, keys, values, key_scales, mix):
    """`component_attention` with the components split over TP: every rank scores all `np`
    heads against its `nc/t` components; a reduce-scatter over heads completes each rank's
    scores, and the same again for the outputs. Per step it moves `[b, np, s, end]` twice."""
    group = mix.tp_group
    rank, nc_loc = group.rank(), keys.shape[2]
    rows = slice(rank * nc_loc, (rank + 1) * nc_loc)
    query = gather_rows(_heads_first(step.query, 2), group).movedim(0, 2)  # [b, s, np, hn]
    num_heads = query.shape[2]
    partial = component_scores(query, keys, per_head(mix.key_mix[rows], num_heads))
    scores = reduce_scatter_to_sequence_parallel_region(_heads_first(partial, 1), group)
    probs = softmax_scores(scores.movedim(0, 1), step.scale, key_scales, step.mask)
    probs = gather_rows(_heads_first(probs, 1), group).movedim(0, 1)  # [b, np, s, end]
    partial = component_values(probs, values, per_head(mix.value_mix[rows], num_heads))
    out = reduce_scatter_to_sequence_parallel_region(_heads_first(partial, 2), group)
    return out.movedim(0, 2)  # [b, s, np_loc, hn]
