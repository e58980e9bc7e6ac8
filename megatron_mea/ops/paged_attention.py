# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Modified from vLLM 0.32.0 (vllm/v1/attention/ops/triton_unified_attention.py and
# triton_attention_helpers.py; authors of the original: Burkhard Ringlein, Jan van Lunteren,
# Chih-Chieh Yang, Thomas Parnell), licensed under the Apache License 2.0
# (http://www.apache.org/licenses/LICENSE-2.0). Changes made for megatron_mea, 2026:
# - the per-(token, K/V head) key scale of vLLM's int8-per-token-head branch is generalised to
#   a scale per (token, group of SCALE_GROUP query heads), gathered per query row: with one
#   K/V head (MEA's component row) every query head reads the row once and multiplies its
#   logits by its own group's scale; with the value scales gone (always 1);
# - removed: ALiBi, softcap, sinks, sliding window and chunked attention, the qq bias,
#   multimodal prefix ranges, R-SWA, per-sequence causality, FP8 (queries, cache, output),
#   the Intel tensor-descriptor loads, vLLM's logger, envs and platform queries;
# - the block table is read under the tile mask; fp32 dots are IEEE (no TF32);
# - a Python wrapper of this package's own (`paged_attention`, `SplitBuffers`).
"""Paged attention in Triton for MEA's scaled-components cache (and plain GQA caches).

The kernel is vLLM's `unified_attention` (one program per (request, query tile, K/V head),
looping over the request's blocks through the block table with an online softmax; a split-KV
"3D" form for decode batches, whose segments `_reduce_segments` combines) with one change that
matters: the logit of query head `h` over token `t` is multiplied by `key_scales[t, h //
SCALE_GROUP]`. For MEA's scaled components (`integrations/vllm/scaled_cache.py`) the cache has
one K/V head whose key row is the `nc` RoPE'd components (`D = nc*hn`), the scales are the
`ng` inverse RMS `r_g` of the composite keys, and `SCALE_GROUP = np/ng`: each component row is
read once per query tile for every query head (vLLM's own kernel, called with the `ng` groups as
K/V heads of stride 0 over the row, reads it `ng` times). With `key_scales=None` it is plain
paged GQA attention (the original model's layout).

Imports torch and triton only (no vLLM): the GPU acceptance drives it on a machine without
vLLM. Under `TRITON_INTERPRET=1` (set before triton is imported) it runs on CPU tensors.

Shape legend: `T` tokens of the batch (padding included), `R` requests, `np` query heads,
`nk` K/V heads, `D` head size of the dot products (and of the values), `ng` scale columns,
`bs` tokens per block.
"""

import dataclasses
from typing import Optional

import torch

from megatron_mea._optional import import_extra

_FEATURE = "megatron_mea.ops.paged_attention (the paged Triton kernel)"
triton = import_extra("triton", _FEATURE)
tl = import_extra("triton.language", _FEATURE)


@triton.jit
def _cdiv(x, y):
    return (x + y - 1) // y


@triton.jit
def _find_seq_idx(query_start_len_ptr, target_idx, num_seqs, BLOCK_Q: tl.constexpr,
                  use_q_block_mode: tl.constexpr):
    """Binary search over the cumulative query lengths (in query tiles when
    `use_q_block_mode`: each request's start counted in tiles, plus one per request)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        val = tl.load(query_start_len_ptr + mid)
        mid_val = val // BLOCK_Q + mid if use_q_block_mode else val
        if mid_val <= target_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    output_ptr, query_ptr, key_cache_ptr, value_cache_ptr, key_scales_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_len_ptr,
    segm_output_ptr, segm_max_ptr, segm_expsum_ptr,
    scale, num_seqs,
    num_query_heads: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    block_table_stride: tl.int64,
    query_stride_0: tl.int64, query_stride_1: tl.int64,
    output_stride_0: tl.int64, output_stride_1: tl.int64,
    stride_k_cache_0: tl.int64, stride_k_cache_1: tl.int64, stride_k_cache_2: tl.int64,
    stride_v_cache_0: tl.int64, stride_v_cache_1: tl.int64, stride_v_cache_2: tl.int64,
    stride_s_0: tl.int64, stride_s_1: tl.int64, stride_s_2: tl.int64,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SCALE_GROUP: tl.constexpr,  # query heads per scale column; 0: no key scales
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
    IS_3D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_global_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    segm_idx = tl.program_id(2) if IS_3D else 0

    seq_idx = _find_seq_idx(query_start_len_ptr, q_block_global_idx, num_seqs, BLOCK_Q, True)
    cur_batch_in_all_start_index = tl.load(query_start_len_ptr + seq_idx)
    q_block_local_idx = q_block_global_idx - (cur_batch_in_all_start_index // BLOCK_Q + seq_idx)
    cur_batch_query_len = tl.load(query_start_len_ptr + seq_idx + 1) - cur_batch_in_all_start_index
    if q_block_local_idx * BLOCK_Q >= cur_batch_query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    if IS_3D:
        tiles_per_segment = _cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
        if segm_idx * tiles_per_segment * TILE_SIZE >= seq_len:
            return
    else:
        tiles_per_segment = 0

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    # Row m of the tile: query token m // num_queries_per_kv, head m % num_queries_per_kv of
    # this K/V head's group.
    query_pos = q_block_local_idx * BLOCK_Q + offs_m // num_queries_per_kv
    query_offset_0 = cur_batch_in_all_start_index + query_pos
    query_offset_1 = kv_head_idx * num_queries_per_kv + offs_m % num_queries_per_kv
    query_offset = (query_offset_0[:, None] * query_stride_0
                    + query_offset_1[:, None] * query_stride_1 + offs_d[None, :])
    dim_mask = offs_d < HEAD_SIZE
    query_mask_0 = query_pos < cur_batch_query_len
    query_mask_1 = query_offset_1 < num_query_heads
    Q = tl.load(query_ptr + query_offset,
                mask=dim_mask[None, :] & query_mask_0[:, None] & query_mask_1[:, None],
                other=0.0)

    block_table_offset = seq_idx * block_table_stride
    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    context_len = seq_len - cur_batch_query_len

    # Causal: the longest prefix any query row of this tile sees.
    max_seq_prefix_len = (context_len + q_block_local_idx * BLOCK_Q
                          + (BLOCK_M - 1) // num_queries_per_kv + 1)
    max_seq_prefix_len = tl.minimum(max_seq_prefix_len, seq_len)
    num_tiles = _cdiv(max_seq_prefix_len, TILE_SIZE)
    if IS_3D:
        loop_lo = segm_idx * tiles_per_segment
        loop_hi = tl.minimum((segm_idx + 1) * tiles_per_segment, num_tiles)
    else:
        loop_lo = 0
        loop_hi = num_tiles

    for j in range(loop_lo, loop_hi):
        seq_offset = j * TILE_SIZE + offs_t
        tile_mask = seq_offset < max_seq_prefix_len
        physical_block_idx = tl.load(block_tables_ptr + block_table_offset
                                     + seq_offset // BLOCK_SIZE, mask=tile_mask,
                                     other=0).to(tl.int64)
        slot = seq_offset % BLOCK_SIZE
        k_offset = (physical_block_idx[None, :] * stride_k_cache_0
                    + kv_head_idx * stride_k_cache_2 + offs_d[:, None]
                    + slot[None, :] * stride_k_cache_1)
        v_offset = (physical_block_idx[:, None] * stride_v_cache_0
                    + kv_head_idx * stride_v_cache_2 + offs_d[None, :]
                    + slot[:, None] * stride_v_cache_1)
        # K : (HEAD_SIZE_PADDED, TILE_SIZE), V : (TILE_SIZE, HEAD_SIZE_PADDED)
        K = tl.load(key_cache_ptr + k_offset, mask=dim_mask[:, None] & tile_mask[None, :],
                    other=0.0).to(Q.dtype)
        V = tl.load(value_cache_ptr + v_offset, mask=dim_mask[None, :] & tile_mask[:, None],
                    other=0.0).to(Q.dtype)

        S = tl.dot(Q, K, input_precision=DOT_PRECISION) * scale
        if SCALE_GROUP > 0:
            # The key scale of each row's own group (vLLM: of the K/V head, one per column).
            scale_offset = (physical_block_idx[None, :] * stride_s_0
                            + slot[None, :] * stride_s_1
                            + (query_offset_1 // SCALE_GROUP)[:, None] * stride_s_2)
            key_scales = tl.load(key_scales_ptr + scale_offset,
                                 mask=tile_mask[None, :] & query_mask_1[:, None], other=1.0)
            S = S * key_scales.to(tl.float32)

        seq_mask = seq_offset[None, :] <= (context_len + query_pos)[:, None]
        S = tl.where(query_mask_1[:, None] & query_mask_0[:, None] & seq_mask, S,
                     float("-inf"))
        # Online softmax (a fully masked row keeps m_j = 0 so that exp gives no NaN).
        m_j = tl.maximum(M, tl.max(S, axis=1))
        m_j = tl.where(m_j > float("-inf"), m_j, 0.0)
        P = tl.exp(S - m_j[:, None])
        alpha = tl.exp(M - m_j)
        L = L * alpha + tl.sum(P, axis=1)
        M = m_j
        acc = acc * alpha[:, None]
        acc += tl.dot(P.to(V.dtype), V, input_precision=DOT_PRECISION)

    if IS_3D:
        segm_output_offset = (
            query_offset_0[:, None].to(tl.int64)
            * (num_query_heads * NUM_SEGMENTS_PER_SEQ * HEAD_SIZE_PADDED)
            + query_offset_1[:, None] * (NUM_SEGMENTS_PER_SEQ * HEAD_SIZE_PADDED)
            + segm_idx * HEAD_SIZE_PADDED + offs_d[None, :])
        tl.store(segm_output_ptr + segm_output_offset, acc,
                 mask=dim_mask[None, :] & query_mask_0[:, None] & query_mask_1[:, None])
        segm_offset = (query_offset_0.to(tl.int64) * (num_query_heads * NUM_SEGMENTS_PER_SEQ)
                       + query_offset_1 * NUM_SEGMENTS_PER_SEQ + segm_idx)
        tl.store(segm_max_ptr + segm_offset, M, mask=query_mask_0 & query_mask_1)
        tl.store(segm_expsum_ptr + segm_offset, L, mask=query_mask_0 & query_mask_1)
    else:
        acc = acc / L[:, None]
        output_offset = (query_offset_0[:, None] * output_stride_0
                         + query_offset_1[:, None] * output_stride_1 + offs_d[None, :])
        tl.store(output_ptr + output_offset, acc,
                 mask=dim_mask[None, :] & query_mask_0[:, None] & query_mask_1[:, None])


@triton.jit
def _reduce_segments(
    output_ptr, segm_output_ptr, segm_max_ptr, segm_expsum_ptr, seq_lens_ptr,
    query_start_len_ptr, num_seqs,
    num_query_heads: tl.constexpr,
    output_stride_0: tl.int64, output_stride_1: tl.int64,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
):
    """One program per (token, query head): the split-KV segments' partial outputs rescaled to
    the common maximum and summed."""
    query_token_idx = tl.program_id(0)
    query_head_idx = tl.program_id(1)
    if query_token_idx >= tl.load(query_start_len_ptr + num_seqs):
        return  # a padding token (vLLM's writes it; here it is left alone)
    seq_idx = _find_seq_idx(query_start_len_ptr, query_token_idx, num_seqs, BLOCK_Q, False)
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    tiles_per_segment = _cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
    act_num_segments = _cdiv(seq_len, tiles_per_segment * TILE_SIZE)
    segm_mask = tl.arange(0, NUM_SEGMENTS_PER_SEQ) < act_num_segments
    dim_mask = tl.arange(0, HEAD_SIZE_PADDED) < HEAD_SIZE
    segm_offset = (query_token_idx.to(tl.int64) * (num_query_heads * NUM_SEGMENTS_PER_SEQ)
                   + query_head_idx * NUM_SEGMENTS_PER_SEQ + tl.arange(0, NUM_SEGMENTS_PER_SEQ))
    segm_max = tl.load(segm_max_ptr + segm_offset, mask=segm_mask, other=float("-inf"))
    overall_max = tl.max(segm_max)
    segm_expsum = tl.load(segm_expsum_ptr + segm_offset, mask=segm_mask, other=0.0)
    overall_expsum = tl.sum(segm_expsum * tl.exp(segm_max - overall_max))
    segm_output_offset = (
        query_token_idx.to(tl.int64) * (num_query_heads * NUM_SEGMENTS_PER_SEQ * HEAD_SIZE_PADDED)
        + query_head_idx * (NUM_SEGMENTS_PER_SEQ * HEAD_SIZE_PADDED)
        + tl.arange(0, NUM_SEGMENTS_PER_SEQ)[:, None] * HEAD_SIZE_PADDED
        + tl.arange(0, HEAD_SIZE_PADDED)[None, :])
    segm_output = tl.load(segm_output_ptr + segm_output_offset,
                          mask=segm_mask[:, None] & dim_mask[None, :], other=0.0)
    segm_output *= tl.exp(segm_max - overall_max)[:, None]
    acc_sum = tl.sum(segm_output, axis=0)
    acc = tl.where(overall_expsum == 0.0, 0.0, acc_sum / overall_expsum)
    output_offset = (query_token_idx * output_stride_0 + query_head_idx * output_stride_1
                     + tl.arange(0, HEAD_SIZE_PADDED))
    tl.store(output_ptr + output_offset, acc, mask=dim_mask)


# vLLM's Triton backend: split-KV (3D) decode below this many K/V-head programs per step
# (MIN_LAUNCH_GRID_SIZE_2D), 16 segments per request (NUM_PAR_SOFTMAX_SEGMENTS).
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_SEGMENTS = 16


@dataclasses.dataclass
class SplitBuffers:
    """fp32 scratch of the split-KV decode: `output [tokens, np, segments, D_pad]`, `max`,
    `expsum [tokens, np, segments]`. Decode steps of at most `max_seqs` requests use it (vLLM's
    `seq_threshold_3D`); allocated once (the builder's, so that CUDA graphs replay them)."""

    output: torch.Tensor
    max: torch.Tensor
    expsum: torch.Tensor
    max_seqs: int

    @classmethod
    def allocate(cls, max_seqs: int, num_heads: int, head_size: int, device,
                 segments: int = NUM_SEGMENTS) -> "SplitBuffers":
        padded = triton.next_power_of_2(head_size)
        shape = (max_seqs, num_heads, segments)
        return cls(torch.empty(*shape, padded, dtype=torch.float32, device=device),
                   torch.empty(shape, dtype=torch.float32, device=device),
                   torch.empty(shape, dtype=torch.float32, device=device), max_seqs)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    output: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, max_query_len: int,
                    scale: float, key_scales: Optional[torch.Tensor] = None,
                    split: Optional[SplitBuffers] = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached positions.

    Args:
        query: `[T, np, D]` (any strides but the last, 1).
        key_cache, value_cache: `[blocks, bs, nk, D]` views (the last stride 1; the K/V head
            stride may be 0).
        output: `[T, np, D]`, written for the tokens of the requests (padding left alone).
        query_start_loc: `[R + 1]` int32, start of each request's tokens in the batch.
        seq_lens: `[R]` int32, positions each request has cached, its new tokens included.
        block_table: `[R, max_blocks]` block ids.
        max_query_len: the most new tokens of a request (1: a decode-only batch).
        scale: softmax scale.
        key_scales: `[blocks, bs, ng]` per-token scale of each group of `np/ng` query heads'
            logits (a view; MEA's `r_g`), or None.
        split: split-KV scratch for decode-only batches of at most `split.max_seqs` requests
            (None: always one pass over the cache per query tile).

    Returns:
        `output`.
    """
    num_seqs = seq_lens.shape[0]
    num_query_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_query_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_query_heads}) must be a multiple of the K/V "
                         f"heads ({num_kv_heads})")
    scale_group = 0
    if key_scales is not None:
        if num_query_heads % key_scales.shape[2]:
            raise ValueError(f"key_scales' {key_scales.shape[2]} columns must divide the "
                             f"{num_query_heads} query heads")
        scale_group = num_query_heads // key_scales.shape[2]
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query, key_cache and value_cache need a unit stride in their last dim")
    num_queries_per_kv = num_query_heads // num_kv_heads
    block_m = 16 if num_queries_per_kv <= 16 else triton.next_power_of_2(num_queries_per_kv)
    block_q = block_m // num_queries_per_kv
    # An upper bound of sum_i ceil(query_len_i / BLOCK_Q) without reading the lengths.
    total_num_q_blocks = query.shape[0] // block_q + num_seqs
    use_3d = (split is not None and max_query_len == 1 and num_seqs <= split.max_seqs
              and query.shape[0] <= split.output.shape[0])
    element = query.element_size()
    tile_size = 16 if use_3d and element >= 2 else 32
    if use_3d:
        segments = split.output.shape[2]
        grid = (total_num_q_blocks, num_kv_heads, segments)
        segm = (split.output, split.max, split.expsum)
    else:
        segments = 1
        grid = (total_num_q_blocks, num_kv_heads)
        segm = (output, output, output)  # not read in the 2D form
    scales = key_scales if key_scales is not None else key_cache
    scale_strides = key_scales.stride() if key_scales is not None else (0, 0, 0)
    _paged_attention_kernel[grid](
        output, query, key_cache, value_cache, scales, block_table, seq_lens, query_start_loc,
        *segm, scale, num_seqs,
        num_query_heads=num_query_heads, num_queries_per_kv=num_queries_per_kv,
        block_table_stride=block_table.stride(0),
        query_stride_0=query.stride(0), query_stride_1=query.stride(1),
        output_stride_0=output.stride(0), output_stride_1=output.stride(1),
        stride_k_cache_0=key_cache.stride(0), stride_k_cache_1=key_cache.stride(1),
        stride_k_cache_2=key_cache.stride(2),
        stride_v_cache_0=value_cache.stride(0), stride_v_cache_1=value_cache.stride(1),
        stride_v_cache_2=value_cache.stride(2),
        stride_s_0=scale_strides[0], stride_s_1=scale_strides[1], stride_s_2=scale_strides[2],
        BLOCK_SIZE=block_size, TILE_SIZE=tile_size, HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size), BLOCK_Q=block_q, BLOCK_M=block_m,
        SCALE_GROUP=scale_group, NUM_SEGMENTS_PER_SEQ=segments, IS_3D=use_3d,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    if use_3d:
        _reduce_segments[(query.shape[0], num_query_heads)](
            output, split.output, split.max, split.expsum, seq_lens, query_start_loc, num_seqs,
            num_query_heads=num_query_heads,
            output_stride_0=output.stride(0), output_stride_1=output.stride(1),
            TILE_SIZE=tile_size, HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=triton.next_power_of_2(head_size), BLOCK_Q=block_q,
            NUM_SEGMENTS_PER_SEQ=segments,
        )
    return output
