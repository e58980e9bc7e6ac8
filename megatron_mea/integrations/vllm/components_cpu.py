"""vLLM's CPU attention for MEA's plain component cache (`CacheKind.COMPONENTS`), prefill at the
original model's cost.

The cache is the stock one of `Attention(np, head_size=nc*hn, num_kv_heads=1)`: one K/V head
per token holding the `nc` RoPE'd component keys and the `nc` component values, written by
vLLM's own `cpu_attn_reshape_and_cache`. Decode tokens read it with the query-side trick
(`prefill.GroupMix`: the mixed query `q~_h [nc*hn]` against the component row, then `A_v` on the
per-component outputs) through vLLM's C++ kernel, half the bytes of the original's cache. A
prefill chunk attends over its request's composite heads `sum_c A[c, g] (K_c, V_c)` at head dim
`hn` through the same kernel (`prefill.attend_prefills`), not `nc` times the FLOPs.

Why a backend of its own rather than the layer splitting the batch around vLLM's stock one: the
stock `Attention` writes and attends every token of a step in one call, with one query width;
decode and prefill here need different queries (`q~_h` of width `nc*hn`, `q_h` of `hn`) and a
different kernel call each over the one cache. So the layer hands this backend its plain
queries and head mix (as the scaled-components backend takes them) and the backend, a subclass
of vLLM's CPU backend (its cache layout, writes, scheduler and kernel unchanged), splits the
batch: its builder has vLLM order each batch decodes first and plans the kernel's decode call.

A chunk after cached tokens reads the request's cached components back through the block table.
vLLM's "vec" and "vec16" layouts (fp32, and bf16 / fp16 without AMX) keep each block's values
as `[bs, nc*hn]` and its keys transposed, `[nc*hn, bs]`; other layouts (AMX's packing of bf16,
Arm's) are not read back: there every token takes the query-side trick (exact, the old cost).

Shape legend: `T` tokens of the batch, `R` requests, `np` query heads of this rank, `nc`
components, `hn` head dim, `W = nc*hn`, `bs` tokens per block.
"""

import dataclasses

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionImpl, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from megatron_mea.integrations.vllm.prefill import (
    Components,
    GroupMix,
    attend_prefills,
    leading_decodes,
    refuse_unsupported,
)

_NAME = "MEA_COMPONENTS_CPU"
# vLLM's CPU layouts whose key blocks are plain transposes (read back for chunked prefill).
READABLE_LAYOUTS = ("vec", "vec16")


@dataclasses.dataclass
class ComponentsMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata, its scheduler planned for the first `trick_requests` requests only.

    Attributes (beyond vLLM's):
        query_starts: `[R + 1]` as Python ints.
        seq_lens_list: `[R]` as Python ints.
        trick_requests: the requests read with the query-side trick: the decodes (ordered
            first), or every request where the cache layout is not read back.
    """

    query_starts: list = dataclasses.field(default_factory=list)
    seq_lens_list: list = dataclasses.field(default_factory=list)
    trick_requests: int = 0


def plan(common, isa: str, num_heads: int, head_size: int, dtype: torch.dtype,
         kv_cache_dtype: str = "auto") -> ComponentsMetadata:
    """`ComponentsMetadata` of a batch (vLLM's `CommonAttentionMetadata`, decodes first) for
    the cache layout `isa`: vLLM's kernel planned for the requests the trick reads."""
    query_starts = common.query_start_loc_cpu[:common.num_reqs + 1].tolist()
    trick = leading_decodes(query_starts) if isa in READABLE_LAYOUTS else common.num_reqs
    schedule = None
    if trick:
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=trick, num_heads=num_heads, num_kv_heads=1, head_dim=head_size,
            seq_lens=common.seq_lens[:trick], dtype=dtype,
            query_start_loc=common.query_start_loc[:trick + 1], causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=kv_cache_dtype)
    return ComponentsMetadata(
        num_actual_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
        query_start_loc=common.query_start_loc, max_seq_len=common.max_seq_len,
        seq_lens=common.seq_lens, block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping, scheduler_metadata=schedule,
        query_starts=query_starts, seq_lens_list=common.seq_lens[:common.num_reqs].tolist(),
        trick_requests=trick)


class ComponentsMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder (it picks the layout, `isa`, and sets it on the layers), with the
    batch ordered decodes first and the kernel planned by `plan`."""

    reorder_batch_threshold = 1

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return plan(common_attn_metadata, self.isa, self.num_heads, self.head_dim, self.dtype,
                    self.kv_cache_dtype)


class ComponentsImpl(AttentionImpl[ComponentsMetadata]):
    """Attention over vLLM's CPU cache of one `nc*hn` K/V head, computing `o_h` from the plain
    queries (module docstring); its writes are vLLM's CPU backend's. `head_dim` (`hn`), the
    layer's `head_mix` (`VLLMHeadMix`), `first_group` and `num_groups` (this rank's composite
    heads) come through `Attention`'s extra arguments."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 head_dim=None, head_mix=None, first_group=0, num_groups=None):
        refuse_unsupported("component-cache", num_kv_heads, alibi_slopes, sliding_window,
                           logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                           kv_cache_dtype)
        if head_mix is None or not head_dim or head_size % head_dim or not num_groups:
            raise ValueError(f"MEA's component-cache attention needs the layer's head_mix, "
                             f"num_groups and a head_dim ({head_dim}) dividing {head_size}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype, self.attn_type = 1, kv_cache_dtype, attn_type
        self.kv_sharing_target_layer_name = None
        self.head_dim, self.head_mix = head_dim, head_mix
        self.first_group, self.num_groups = first_group, num_groups

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """vLLM's CPU write (`layer.isa`, the layout, set by the metadata builder)."""
        num_blocks, _, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, 1, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """`query [T, np, W]` (RoPE'd `q_h` in the first `hn`) -> `output [T, np, W]` (`o_h`
        in the first `hn`); the cache already holds this step's tokens."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("MEA's component-cache attention: no fused output "
                                      "quantization")
        if attn_metadata is None:  # the engine's warm-up and profiling runs
            return output
        meta, hn = attn_metadata, self.head_dim
        mix = GroupMix.of(self.head_mix, self.first_group, self.num_groups, self.num_heads)
        num_blocks, _, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, 1, 2 * block_size, -1).chunk(2, dim=2)
        trick = meta.trick_requests
        tricked = meta.query_starts[trick]  # their tokens come first
        if tricked:
            mixed = mix.mix_queries(query[:tricked, :, :hn])
            outputs = torch.empty_like(mixed)
            ops.cpu_attention_with_kv_cache(
                query=mixed, key_cache=key_cache, value_cache=value_cache, output=outputs,
                query_start_loc=meta.query_start_loc[:trick + 1], seq_lens=meta.seq_lens[:trick],
                scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=meta.block_table[:trick], softcap=0.0,
                scheduler_metadata=meta.scheduler_metadata, s_aux=None,
                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype)
            output[:tricked, :, :hn] = mix.mix_outputs(outputs)
        bounds = zip(meta.query_starts[trick:-1], meta.query_starts[trick + 1:],
                     meta.seq_lens_list[trick:])
        prefills = [(request, start, end, length)
                    for request, (start, end, length) in enumerate(bounds, trick) if end > start]
        if prefills:
            first, last = prefills[0][1], prefills[-1][2]
            requests = [self._components(key, value, key_cache, value_cache, meta, *prefill)
                        for prefill in prefills]
            starts = [start - first for _, start, _, _ in prefills] + [last - first]
            output[first:last, :, :hn] = attend_prefills(query[first:last, :, :hn], requests,
                                                         starts, mix, self.scale)
        return output

    def _components(self, key, value, key_cache, value_cache, meta, request, start, end,
                    length) -> Components:
        """`Components` of one prefill request: its new tokens' for a first prefill, else its
        `S` cached positions read back through the block table (keys transposed per block)."""
        if end - start == length:
            keys, values = key[start:end, 0], value[start:end, 0]
        else:
            block_size, width = key_cache.shape[2], key_cache.shape[3]
            blocks = meta.block_table[request, : -(-length // block_size)]
            keys = key_cache[blocks, 0].reshape(-1, width, block_size).transpose(1, 2)
            keys = keys.reshape(-1, width)[:length]
            values = value_cache[blocks, 0].reshape(-1, width)[:length]
        return Components(keys.reshape(length, -1, self.head_dim),
                          values.reshape(length, -1, self.head_dim))


class ComponentsCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend with `ComponentsImpl` and `ComponentsMetadataBuilder`."""

    @staticmethod
    def get_name() -> str:
        return _NAME

    @staticmethod
    def get_impl_cls():
        return ComponentsImpl

    @staticmethod
    def get_builder_cls():
        return ComponentsMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


if _NAME not in AttentionBackendEnum.__members__:  # `Attention` looks its backend up by name
    AttentionBackendEnum.register(_NAME, f"{__name__}.ComponentsCPUBackend")
