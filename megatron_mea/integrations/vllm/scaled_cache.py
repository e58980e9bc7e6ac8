"""vLLM attention backend for MEA's scaled-components cache (`CacheKind.SCALED_COMPONENTS`).

With an RMS k norm a composite key is `r_g * RoPE(w * sum_c A_k[c, g] k_c)`: the inverse RMS
`r_g` of the mixed key is one scalar per composite key and token, and it multiplies the logit
`q_h . k_g` inside the softmax (`ops/decode.py` has the identity). No stock kernel takes a
per-key, per-head-group logit factor, so these layers get a backend of their own that keeps
vLLM's paged cache (KV-cache spec, block tables, slot mapping, chunked prefill, prefix caching
all stock) and computes the attention from it: a Triton kernel on CUDA, torch elsewhere.

Layout: one K/V "head" per token whose key row holds the `nc` RoPE'd components `RoPE(w * k_c)`
followed by the `ng_loc` scales `r_g` of this rank's composite keys, and whose value row holds
the `nc` component values. `Attention(num_heads=np_loc, head_size=nc*hn + ng_loc,
head_size_v=nc*hn, num_kv_heads=1)` gives vLLM's stock `FullAttentionSpec`, so each layer costs
`2*nc*hn + ng_loc` values per token against the baseline's `2*ng*hn`.

The layer hands the attention its RoPE'd queries `q_h` in the first `hn` of each head's
`nc*hn + ng_loc` (the rest is not read) and its head mix (`head_mix`, `first_group`, through
`Attention`'s extra arguments); the attention writes the composite-head output `o_h` into the
first `hn` of each head's `nc*hn` output.

On CUDA every token goes through a paged Triton kernel over the cache in place
(`triton_attention.scale_group_attention`: vLLM's `unified_attention` with a logit scale per
group of query heads, `megatron_mea.ops.paged_attention`) with the mixed queries
`q~_h = [A_k[0, g] q_h ... A_k[nc-1, g] q_h]`, its per-component outputs mixed with `A_v`; the
builder gives its metadata, and vLLM may capture it in CUDA graphs. On the CPU (any other
device) the batch is ordered decodes first (`reorder_batch_threshold = 1`):
- decode tokens (requests with one new token) read the cache rows with the mixed queries,
  batched over the requests and blockwise over their block tables, and their per-component
  outputs are mixed with `A_v` (`paged_decode`: a compiled C loop for fp32 and bf16 caches,
  torch otherwise);
- prefill tokens (requests with more new tokens) attend over their requests' composite heads
  rebuilt from the rows (`prefill`: the new tokens' own rows for a first prefill, the rows
  read through the block table after cached ones) through vLLM's C++ attention at head dim
  `hn`, the original model's cost.
All exact.

Shape legend: `T` tokens of the batch, `np` query heads of this rank, `ng` this rank's composite
keys (scales per token), `C` a cache row (`nc*hn + ng` key entries, then `nc*hn` values), `S`
positions a request has cached, `s` its new tokens, `bs` tokens per block.
"""

import dataclasses
from typing import ClassVar, Optional

import torch
from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_interface import KVCacheLayout

from megatron_mea.integrations.vllm.paged_decode import paged_decode
from megatron_mea.integrations.vllm.prefill import (
    Components,
    GroupMix,
    attend_prefills,
    leading_decodes,
    refuse_unsupported,
)

_NAME = "MEA_SCALED_COMPONENTS"


@dataclasses.dataclass
class ScaledComponentsMetadata:
    """What the attention needs of a batch; the per-request bounds as Python ints, read once per
    step rather than once per layer.

    Attributes:
        num_actual_tokens: tokens of the batch without padding.
        query_starts: `[R + 1]` start of each request's new tokens in the batch.
        seq_lens: `[R]` positions each request has cached once this step's tokens are written.
        block_table: `[R, max_blocks]` block ids of each request.
        slot_mapping: `[T]` cache slot of each new token (`block * bs + offset`; -1 = padding).
        num_decodes: the first `num_decodes` requests have one new token each (decodes; the
            batch is ordered decodes first), the others are prefill chunks.
        query_start_loc, seq_lens_tensor, max_query_len, max_seq_len: the bounds as device
            tensors (`[R + 1]`, `[R]` int32) and their maxima, for the Triton kernel (CUDA).
        split: the kernel's split-KV scratch for decode steps (CUDA), or None.
    On CUDA `seq_lens` is None (reading it would wait for the device; the kernel does not).
    """

    num_actual_tokens: int
    query_starts: Optional[list]
    seq_lens: Optional[list]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int = 0
    query_start_loc: Optional[torch.Tensor] = None
    seq_lens_tensor: Optional[torch.Tensor] = None
    max_query_len: int = 0
    max_seq_len: int = 0
    split: Optional[object] = None  # ops.paged_attention.SplitBuffers


class ScaledComponentsMetadataBuilder(AttentionMetadataBuilder[ScaledComponentsMetadata]):
    """Builds `ScaledComponentsMetadata` from vLLM's common metadata of a batch, and has vLLM
    order each batch decodes first (the CPU path's split; the kernel takes any order).

    CUDA graphs as vLLM's Triton backend (`TritonAttentionMetadataBuilder`): on CUDA the kernel
    reads only the engine's persistent tensors and this builder's split-KV scratch, so any batch,
    prefill and decode mixed, may be captured; the split-KV form serves decode steps of up to
    `split.max_seqs` requests, matched to a capture size so that each graph keeps one form. The
    torch path runs on the CPU, where vLLM captures no graphs.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.split = None
        if torch.device(device).type == "cuda":
            from megatron_mea.ops.paged_attention import MIN_LAUNCH_GRID_SIZE_2D, SplitBuffers

            # One K/V head: below this many requests a decode step splits each over segments.
            max_seqs = MIN_LAUNCH_GRID_SIZE_2D
            compilation = vllm_config.compilation_config
            if compilation.cudagraph_mode in (CUDAGraphMode.FULL_AND_PIECEWISE,
                                              CUDAGraphMode.FULL_DECODE_ONLY,
                                              CUDAGraphMode.FULL):
                max_seqs = min(compilation.cudagraph_capture_sizes,
                               key=lambda size: abs(size - max_seqs))
            heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                     or vllm_config.model_config.get_num_attention_heads(
                         vllm_config.parallel_config))
            self.split = SplitBuffers.allocate(max_seqs, heads, kv_cache_spec.head_size_v,
                                               device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ScaledComponentsMetadata:
        common = common_attn_metadata
        on_cuda = self.split is not None
        query_starts = common.query_start_loc_cpu[:common.num_reqs + 1].tolist()
        return ScaledComponentsMetadata(
            num_actual_tokens=common.num_actual_tokens,
            query_starts=query_starts,
            seq_lens=None if on_cuda else common.seq_lens[:common.num_reqs].tolist(),
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping,
            num_decodes=leading_decodes(query_starts),
            query_start_loc=common.query_start_loc,
            seq_lens_tensor=common.seq_lens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            split=self.split,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """As vLLM's Triton backend: captured with one cached position per request (a capture
        at the model's length would be slow), the lengths being read at replay."""
        meta = self.build(0, common_attn_metadata)
        meta.seq_lens_tensor.fill_(1)
        return meta


class ScaledComponentsImpl(AttentionImpl[ScaledComponentsMetadata]):
    """Writes and reads the scaled-components rows (module docstring); `num_scales` (`ng_loc`),
    `head_dim` (`hn`), the layer's `head_mix` (`VLLMHeadMix`) and `first_group` (this rank's
    first composite head) come through `Attention`'s extra arguments."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 num_scales=None, head_dim=None, head_mix=None, first_group=0):
        refuse_unsupported("scaled-components", num_kv_heads, alibi_slopes, sliding_window,
                           logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                           kv_cache_dtype)
        if not num_scales or num_heads % num_scales:
            raise ValueError(f"num_scales ({num_scales}) must divide num_heads ({num_heads})")
        if head_mix is None or not head_dim or (head_size - num_scales) % head_dim:
            raise ValueError(f"MEA's scaled-components attention needs the layer's head_mix and "
                             f"a head_dim ({head_dim}) dividing {head_size - num_scales}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = 1, kv_cache_dtype
        self.num_scales, self.head_dim = num_scales, head_dim
        self.key_width = head_size - num_scales  # nc*hn
        self.head_mix, self.first_group = head_mix, first_group
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    def mix(self) -> GroupMix:
        """This rank's head-mixing weights, as loaded."""
        return GroupMix.of(self.head_mix, self.first_group, self.num_scales, self.num_heads)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Write each new token's row: `key [T, 1, nc*hn + ng]`, `value [T, 1, nc*hn]` into
        `kv_cache [blocks, 1, bs, C]` at `slot_mapping [T]`."""
        block_size = kv_cache.shape[2]
        slots = slot_mapping[: key.shape[0]]
        rows = torch.cat([key[: slots.shape[0], 0], value[: slots.shape[0], 0]], dim=-1)
        if kv_cache.is_cuda:
            # No boolean indexing (it waits for the device and cannot be captured in a CUDA
            # graph): padding (-1) writes into block 0, vLLM's null block, which no request
            # holds and no read reaches.
            slots = slots.clamp(min=0)
        else:
            kept = slots >= 0
            slots, rows = slots[kept], rows[kept]
        kv_cache[slots // block_size, 0, slots % block_size] = rows.to(kv_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """`query [T, np, nc*hn + ng]` (RoPE'd `q_h` in the first `hn`) -> `output [T, np,
        nc*hn]` (`o_h` in the first `hn`): each request's new tokens against every position it
        has cached (module docstring)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("MEA's scaled-components attention: no fused output "
                                      "quantization")
        if attn_metadata is None:  # the engine's warm-up and profiling runs
            return output
        if query.is_cuda:
            return self.forward_triton(query, kv_cache, attn_metadata, output)
        meta, hn, mix = attn_metadata, self.head_dim, self.mix()
        decodes = meta.num_decodes  # one token each, the batch's first tokens
        if decodes:
            output[:decodes, :, :hn] = paged_decode(
                query[:decodes, :, :hn], mix, kv_cache, meta.block_table[:decodes],
                meta.seq_lens[:decodes], self.num_scales, self.scale)
        bounds = zip(meta.query_starts[decodes:-1], meta.query_starts[decodes + 1:],
                     meta.seq_lens[decodes:])
        prefills = [(request, start, end, length)
                    for request, (start, end, length) in enumerate(bounds, decodes)
                    if end > start]
        if prefills:
            first, last = prefills[0][1], prefills[-1][2]
            requests = [self._components(key, value, kv_cache, meta, *prefill)
                        for prefill in prefills]
            starts = [start - first for _, start, _, _ in prefills] + [last - first]
            output[first:last, :, :hn] = attend_prefills(query[first:last, :, :hn], requests,
                                                         starts, mix, self.scale)
        return output

    def forward_triton(self, query, kv_cache, meta, output):
        """`forward` on CUDA, every token through the Triton kernel (module docstring); on CPU
        tensors under Triton's interpreter too (the tests)."""
        from megatron_mea.integrations.vllm.triton_attention import scale_group_attention

        hn, mix = self.head_dim, self.mix()
        rows = query.new_zeros(query.shape[0], self.num_heads, self.key_width)
        scale_group_attention(mix.mix_queries(query[:, :, :hn]), kv_cache, rows, meta,
                              self.key_width, self.head_size, self.scale)
        output[:, :, :hn] = mix.mix_outputs(rows)
        return output

    def _components(self, key, value, kv_cache, meta, request, start, end, length):
        """`Components` of one prefill request: its new tokens' rows for a first prefill, else
        its `S` cached rows (this step's written already) through the block table."""
        width, head_size = self.key_width, self.head_size
        if end - start == length:
            keys, values = key[start:end, 0], value[start:end, 0]
        else:
            block_size = kv_cache.shape[2]
            blocks = meta.block_table[request, : -(-length // block_size)]
            rows = kv_cache[blocks, 0].reshape(-1, kv_cache.shape[-1])[:length]
            keys, values = rows[:, :head_size], rows[:, head_size:]
        positions = keys.shape[0]
        return Components(keys[:, :width].reshape(positions, -1, self.head_dim),
                          values.reshape(positions, -1, self.head_dim),
                          keys[:, width:head_size])


class ScaledComponentsBackend(AttentionBackend):
    """vLLM's view of the scaled-components attention: a stock `FullAttentionSpec` (its
    `head_size`, `head_size_v` as the module docstring says), any block size and head size."""

    forward_includes_kv_cache_update = False
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @staticmethod
    def get_name() -> str:
        return _NAME

    @staticmethod
    def get_impl_cls():
        return ScaledComponentsImpl

    @staticmethod
    def get_builder_cls():
        return ScaledComponentsMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Rows are read per (block, token): any layout with the layer outermost works.
        return (KVCacheLayout.LBHNC,)


if _NAME not in AttentionBackendEnum.__members__:  # `Attention` looks its backend up by name
    AttentionBackendEnum.register(_NAME, f"{__name__}.ScaledComponentsBackend")
