"""MEA's KV cache in Megatron's static inference context, and the attention over it.

Each MEA layer keeps Megatron's pair `context.key_value_memory_dict[layer_number] =
(keys, values)`, sequence-major with the batch at dim 1 and the keys `[T, B, heads, hn]` as
Megatron's own buffers (so `StaticInferenceContext.swap_key_value_dict` still reorders them and
the key shape still says how many heads are cached), in one of two kinds:

- `components` (`nc < ng`): this rank's component keys `RoPE(w * k_c)` (`w` the k-norm scale)
  and component values. With a k norm, each token's values are followed by the inverse RMS
  `r_g` of each of this rank's composite keys (`ng_loc` scalars in the cache dtype; they ride
  with the values because Megatron's entry is a pair). Attention mixes on the query side
  (`ops/decode.py`).
- `composites` (`nc == ng`, where components save nothing, or a k norm that is not RMS-type):
  the composite keys after the k norm and RoPE, and the composite values, as plain GQA.

Shape legend: `T` the context's max sequence length, `B` its max batch, `s` new tokens, `b` the
batch slice, `n` cached heads (`nc_loc`, all `nc` when duplicated, or `ng_loc`), `hn` head dim.
"""

from typing import Optional, Tuple

import torch
from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import L2Norm

from megatron_mea.ops.decode import (
    component_attention,
    component_scores,
    component_values,
    grouped_attention,
    per_head,
    softmax_scores,
)
from megatron_mea.parallel import gather_rows

COMPONENTS, COMPOSITES = "components", "composites"


def rms_key_norm(norm) -> Optional[Tuple[Optional[torch.Tensor], Optional[float]]]:
    """`(scale, eps)` when `norm(x) = x * rsqrt(mean(x^2) + eps) * scale` per head (scale None
    means 1, eps None torch's default); `(None, None)` for no norm; None for any other norm
    (e.g. LayerNorm: its mean and bias do not factor out of the mix)."""
    if norm is None or isinstance(norm, IdentityOp):
        return None, None
    if isinstance(norm, torch.nn.RMSNorm):
        return norm.weight, norm.eps
    if isinstance(norm, L2Norm):
        return None, norm.eps
    if type(norm).__name__ == "RMSNorm" and hasattr(norm, "weight") and hasattr(norm, "eps"):
        # Transformer Engine's RMSNorm (Megatron's TENorm); zero-centred gamma stores w - 1.
        offset = 1.0 if getattr(norm, "zero_centered_gamma", False) else 0.0
        return norm.weight + offset, norm.eps
    return None


class MEAKVCache:
    """One MEA layer's cache buffers (see the module docstring for the two kinds).

    Attributes:
        kind: `components` or `composites`.
        keys: `[T, B, n, hn]`.
        values: `[T, B, n, hn]`, or `[T, B, n*hn + ng_loc]` (components, then key scales).
    """

    def __init__(self, kind, keys, values):
        self.kind, self.keys, self.values = kind, keys, values
        self.width = keys.shape[2] * keys.shape[3]  # n*hn: where the key scales start

    @classmethod
    def of(cls, context, layer_number, kind, num_heads, head_dim, num_scales, like):
        """The layer's cache in `context`, allocated on first use.

        Args:
            context: a `StaticInferenceContext`.
            layer_number: the layer's (1-based) number, the dict key.
            kind: `components` or `composites`.
            num_heads: n, cached heads on this rank.
            head_dim: hn.
            num_scales: key scales per token (`ng_loc` with an RMS k norm, else 0).
            like: a tensor of the cache's dtype and device.
        """
        entry = context.key_value_memory_dict.get(layer_number)
        if entry is None:
            shape = (context.max_sequence_length, context.max_batch_size, num_heads, head_dim)
            value_shape = (*shape[:2], num_heads * head_dim + num_scales) if num_scales else shape
            entry = (like.new_empty(shape), like.new_empty(value_shape))
            context.key_value_memory_dict[layer_number] = entry
        return cls(kind, *entry)

    def write(self, start, batch, keys, values, key_scales=None) -> None:
        """Store `s` new tokens at positions `[start, start + s)` of the rows `batch`.

        Args:
            keys, values: `[s, b, n, hn]`.
            key_scales: `[s, b, ng_loc]` (components with an RMS k norm), else None.
        """
        positions = slice(start, start + keys.shape[0])
        self.keys[positions, batch] = keys
        if key_scales is None:
            self.values[positions, batch] = values
        else:
            self.values[positions, batch, : self.width] = values.flatten(2)
            self.values[positions, batch, self.width :] = key_scales

    def read(self, end, batch):
        """Views of positions `[0, end)`: keys, values `[b, end, n, hn]` and the key scales
        `[b, end, ng_loc]` (None when not stored)."""
        keys, values = self.keys[:end, batch], self.values[:end, batch]
        scales = None
        if values.dim() == 3:
            scales = values[..., self.width :].transpose(0, 1)
            values = values[..., : self.width].view(keys.shape)
        return keys.transpose(0, 1), values.transpose(0, 1), scales


def attend(cache, end, batch, query, key_mix, value_mix, scale, mask, tp_group, sharded):
    """Attention of the new tokens' queries over the cached positions `[0, end)`.

    Args:
        cache: an `MEAKVCache`.
        end, batch: the cached positions and batch rows to read.
        query: `[b, s, np_loc, hn]`, RoPE'd.
        key_mix, value_mix: `A_k`, `A_v` `[nc, ng]` (components only).
        scale: softmax scale.
        mask: True = masked, broadcastable to `[b, np_loc, s, end]`, or None.
        tp_group: the tensor-parallel group.
        sharded: components split over the TP ranks (`nc >= t > 1`): each rank scores all heads
            against its components and the partial sums meet in reduce-scatters.

    Returns:
        `[b, s, np_loc, hn]`.
    """
    keys, values, key_scales = cache.read(end, batch)
    if key_scales is not None:
        key_scales = key_scales.transpose(1, 2)  # [b, ng_loc, end]
    if cache.kind == COMPOSITES:
        return grouped_attention(query, keys, values, scale, mask)
    world, rank = tp_group.size(), tp_group.rank()
    groups = key_mix.shape[1] // world
    if not sharded:  # every component here; this rank's composite groups
        local = slice(rank * groups, (rank + 1) * groups) if world > 1 else slice(None)
        return component_attention(
            query, keys, values, key_mix[:, local], value_mix[:, local], scale, key_scales, mask
        )
    return _sharded_component_attention(
        query, keys, values, key_mix, value_mix, scale, key_scales, mask, tp_group
    )


def _heads_first(x, head_dim):
    return x.movedim(head_dim, 0).contiguous()


def _sharded_component_attention(
    query, keys, values, key_mix, value_mix, scale, key_scales, mask, tp_group
):
    """`component_attention` with the components split over TP: every rank scores all `np`
    heads against its `nc/t` components; a reduce-scatter over heads completes each rank's
    scores, and the same again for the outputs. Per step it moves `[b, np, s, end]` twice."""
    rank, nc_loc = tp_group.rank(), keys.shape[2]
    rows = slice(rank * nc_loc, (rank + 1) * nc_loc)
    query = gather_rows(_heads_first(query, 2), tp_group).movedim(0, 2)  # [b, s, np, hn]
    num_heads = query.shape[2]
    partial = component_scores(query, keys, per_head(key_mix[rows], num_heads))
    scores = reduce_scatter_to_sequence_parallel_region(_heads_first(partial, 1), tp_group)
    probs = softmax_scores(scores.movedim(0, 1), scale, key_scales, mask)  # [b, np_loc, s, end]
    probs = gather_rows(_heads_first(probs, 1), tp_group).movedim(0, 1)
    partial = component_values(probs, values, per_head(value_mix[rows], num_heads))
    out = reduce_scatter_to_sequence_parallel_region(_heads_first(partial, 2), tp_group)
    return out.movedim(0, 2)  # [b, s, np_loc, hn]
