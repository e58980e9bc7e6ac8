"""Prefill over MEA's component caches at the original model's cost: composite heads rebuilt.

A component cache (`CacheKind.COMPONENTS`, `SCALED_COMPONENTS`) holds per token the `nc` RoPE'd
component keys `K_c` (with the k norm's scale `w` applied), the component values `V_c` and, for
the scaled layout, the inverse RMS `r_g` of each composite key. Decode reads that cache with
the query-side trick (`q~_h = [A_k[0, g] q_h ... A_k[nc-1, g] q_h]`, one dot of width `nc*hn`
per cached token: half the bytes of the original's cache). A prefill chunk has many queries
per cached token, so the trick would cost `nc` times the original's attention FLOPs; instead
the chunk's request gets its composite heads back,

    k_g = r_g * sum_c A_k[c, g] K_c      (r_g = 1 without a k norm after the mix)
    v_g = sum_c A_v[c, g] V_c

(RoPE and `w` commute with the mix: `ops/decode.py`), and a stock kernel runs GQA over them at
head dim `hn` with the `ng` composite heads as K/V heads: vLLM's own C++ CPU attention
(`cpu_attention_with_kv_cache`, on a scratch paged cache that holds the composites of this
step's prefill requests), or torch's SDPA on other devices and dtypes (float64). Its causal
mask is bottom-right: the `s` new tokens of a request are its last `s` positions.

What a request's composites are rebuilt from: its new tokens' components alone for a first
prefill (nothing cached before), every cached position otherwise (a chunk after a chunked
prefill's earlier chunks or after a prefix-cache hit), which the backend reads through the
block table (`Components` holds either).

Shape legend: `s` new tokens of a request, `S` positions it attends to (its cached ones and its
new ones), `np` query heads of this rank, `ng` this rank's composite heads, `nc` components,
`hn` head dim, `P` prefill requests of the step.
"""

import dataclasses
from typing import Optional

import torch
from vllm.v1.attention.backend import AttentionType

from megatron_mea.ops.decode import decode_mask, per_head

# Tokens per block of the scratch cache of composites (a multiple of 32: vLLM's "vec" kernels).
SCRATCH_BLOCK = 128


def refuse_unsupported(layout: str, num_kv_heads, alibi_slopes, sliding_window, logits_soft_cap,
                       attn_type, kv_sharing_target_layer_name, kv_cache_dtype) -> None:
    """One `ValueError` naming the first of vLLM's attention settings that the component-cache
    backends do not take (`layout` names the attention in the message)."""
    unsupported = {"num_kv_heads": (num_kv_heads, 1), "alibi_slopes": (alibi_slopes, None),
                   "sliding_window": (sliding_window, None),
                   "logits_soft_cap": (logits_soft_cap, None),
                   "kv_sharing_target_layer_name": (kv_sharing_target_layer_name, None),
                   "attn_type": (attn_type, AttentionType.DECODER),
                   "kv_cache_dtype": (kv_cache_dtype, "auto")}
    for name, (value, needed) in unsupported.items():
        if value != needed:
            raise ValueError(f"MEA's {layout} attention: {name} ({value!r}) must be {needed!r}")


def leading_decodes(query_starts: list) -> int:
    """Requests with one new token at the head of a batch ordered decodes first (vLLM's
    `reorder_batch_threshold = 1`); the rest are prefill chunks."""
    count = 0
    while count + 1 < len(query_starts) and query_starts[count + 1] - query_starts[count] == 1:
        count += 1
    return count


@dataclasses.dataclass(frozen=True)
class GroupMix:
    """The head-mixing weights of one rank's attention layer.

    Attributes:
        key: `A_k [nc, ng]`, the columns of this rank's composite heads.
        value: `A_v [nc, ng]`.
        key_per_head: `[np, nc]`, the column of each query head's group (GQA order).
        value_per_head: `[np, nc]`.
    """

    key: torch.Tensor
    value: torch.Tensor
    key_per_head: torch.Tensor
    value_per_head: torch.Tensor

    @classmethod
    def of(cls, head_mix, first_group: int, num_groups: int, num_heads: int) -> "GroupMix":
        """From the layer's `VLLMHeadMix` (read at each call: the weights load after the layer
        is built) for the groups `first_group .. first_group + num_groups - 1`."""
        local = slice(first_group, first_group + num_groups)
        key = head_mix.key_weight.detach()[:, local]  # inference: no autograd graph
        value = head_mix.value_weight.detach()[:, local]
        return cls(key, value, per_head(key, num_heads).t(), per_head(value, num_heads).t())

    def mix_queries(self, query: torch.Tensor) -> torch.Tensor:
        """`q [t, np, hn]` -> the queries over a component row, `q~ [t, np, nc*hn]`."""
        mixed = query[:, :, None, :] * self.key_per_head.to(query.dtype)[None, :, :, None]
        return mixed.flatten(2)

    def mix_outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-component outputs `p_h @ V_c`, `[t, np, nc*hn]` -> `o_h [t, np, hn]`."""
        tokens, num_heads, width = outputs.shape
        split = outputs.view(tokens, num_heads, self.key.shape[0], width // self.key.shape[0])
        return torch.einsum("thcd,hc->thd", split, self.value_per_head.to(outputs.dtype))


@dataclasses.dataclass
class Components:
    """What one prefill request attends to, as components.

    Attributes:
        keys: `[S, nc, hn]` RoPE'd component keys (k norm's scale applied).
        values: `[S, nc, hn]`.
        scales: `[S, ng]` inverse RMS of the composite keys, or None (plain component cache).
    """

    keys: torch.Tensor
    values: torch.Tensor
    scales: Optional[torch.Tensor] = None

    def composites(self, mix: GroupMix):
        """The composite heads `(k_g, v_g)`, `[S, ng, hn]` each (module docstring)."""
        keys = _mix(self.keys, mix.key)
        if self.scales is not None:
            keys *= self.scales.to(keys.dtype)[:, :, None]
        return keys, _mix(self.values, mix.value)


def _mix(components: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """`sum_c mix[c, g] x_c`: `[S, nc, hn]`, `[nc, ng]` -> `[S, ng, hn]`, one multiply-add per
    component (`nc` is small; an einsum or a GEMM over `nc` copies its operands around)."""
    mix = mix.to(components.dtype)[:, :, None]  # [nc, ng, 1]
    # Contiguous whatever the strides of `components` (vLLM's cache write needs it so).
    out = components.new_empty(components.shape[0], mix.shape[1], components.shape[2])
    torch.mul(components[:, 0, None, :], mix[0], out=out)
    for component in range(1, components.shape[1]):
        out.addcmul_(components[:, component, None, :], mix[component])
    return out


def attend_prefills(query: torch.Tensor, requests: list, query_starts: list, mix: GroupMix,
                    scale: float) -> torch.Tensor:
    """Causal GQA of the prefill tokens over their requests' composite heads.

    Args:
        query: `[sum s, np, hn]` RoPE'd queries of the prefill requests, request after request.
        requests: one `Components` per request (`S` positions; its `s` new tokens the last).
        query_starts: `[P + 1]` start of each request's tokens in `query`.
        mix: the layer's `GroupMix`.
        scale: softmax scale.

    Returns:
        `[sum s, np, hn]`.
    """
    keys, values = zip(*(request.composites(mix) for request in requests))
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16,
                                                       torch.float16):
        return _vllm_cpu_attention(query, keys, values, query_starts, scale)
    return _sdpa(query, keys, values, query_starts, scale)


def _sdpa(query, keys, values, query_starts, scale):
    """torch's SDPA per request (devices and dtypes vLLM's CPU kernel does not take)."""
    output = torch.empty_like(query)
    for request, (key, value) in enumerate(zip(keys, values)):
        start, end = query_starts[request], query_starts[request + 1]
        new, positions = end - start, key.shape[0]
        mask = decode_mask(new, positions, query.device)  # True = masked
        output[start:end] = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], key.transpose(0, 1)[None],
            value.transpose(0, 1)[None], attn_mask=None if mask is None else ~mask,
            scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return output


def _vllm_cpu_attention(query, keys, values, query_starts, scale):
    """vLLM's C++ CPU attention over a scratch paged cache of the composites: each request's
    positions from a block of its own (block table `arange`), one call for every request."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_groups, head_dim = keys[0].shape[1], keys[0].shape[2]
    num_heads, dtype = query.shape[1], query.dtype
    lengths = [key.shape[0] for key in keys]
    counts = [-(-length // SCRATCH_BLOCK) for length in lengths]
    firsts = [sum(counts[:request]) for request in range(len(counts))]
    block_table = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    slots = []
    for request, (first, count, length) in enumerate(zip(firsts, counts, lengths)):
        block_table[request, :count] = torch.arange(first, first + count, dtype=torch.int32)
        slots.append(first * SCRATCH_BLOCK + torch.arange(length))
    isa = _get_attn_isa(dtype, SCRATCH_BLOCK, head_dim)
    # [blocks, ng, 2*bs, hn]: each (block, head) holds its keys, then its values (vLLM's layout).
    scratch = torch.zeros(sum(counts), num_groups, 2 * SCRATCH_BLOCK, head_dim, dtype=dtype)
    key_cache, value_cache = scratch.chunk(2, dim=2)
    keys, values, slots = (parts[0] if len(parts) == 1 else torch.cat(parts)
                           for parts in (keys, values, slots))
    ops.cpu_attn_reshape_and_cache(keys.to(dtype).contiguous(), values.to(dtype).contiguous(),
                                   key_cache, value_cache, slots, isa)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    starts = torch.tensor(query_starts, dtype=torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        len(lengths), num_heads, num_groups, head_dim, seq_lens, dtype, starts, True, -1, isa,
        envs.VLLM_CPU_ATTN_SPLIT_KV)
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(query.contiguous(), key_cache, value_cache, output, starts,
                                    seq_lens, scale, True, None, -1, block_table, 0.0, schedule,
                                    None)
    return output
