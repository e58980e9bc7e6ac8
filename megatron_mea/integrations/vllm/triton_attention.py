"""The scaled-components attention on CUDA: Triton kernels over views of the plugin's cache.

The cache row of a token (`scaled_cache.py`) is `[K_0 ... K_nc-1 | r_0 ... r_ng-1 | V_0 ...
V_nc-1]`: the key row `nc*hn` wide, the `ng` inverse RMS of this rank's composite keys, the
value row. Both kernels read it in place through strided views, and compute, for query head `h`
of group `g` over cached token `t`, the logit `scale * r_g(t) * (q~_h . K(t))`:

- `scale_group_attention`, the one the backend runs: the package's kernel
  (`megatron_mea.ops.paged_attention`, vLLM's `unified_attention` with a scale per group of
  query heads) over one K/V head, so each row is read once per query tile for all `np` heads;
- `stock_unified_attention`: vLLM's own `unified_attention`, unchanged, through its
  int8-per-token-head branch: the `ng` groups as `ng` K/V heads of stride 0 over the same row,
  the scales column as its `k_scale_cache`, unit value scales. Each row is read `ng` times;
  kept as the check that the package's kernel still computes what vLLM's does (the tests run
  both), and as the route that needs no vendored code.

Shape legend: `T` tokens of the batch, `np` query heads, `ng` scale columns (this rank's
composite keys), `C` a cache row, `bs` tokens per block.
"""

import torch


def cache_views(kv_cache: torch.Tensor, key_width: int, head_size: int):
    """Views of `kv_cache [blocks, 1, bs, C]`: keys and values `[blocks, bs, 1, nc*hn]`, scales
    `[blocks, bs, ng]` (`head_size` is the key row's width, `nc*hn + ng`)."""
    rows = kv_cache.select(1, 0)
    return (rows[..., :key_width].unsqueeze(2), rows[..., head_size:].unsqueeze(2),
            rows[..., key_width:head_size])


def scale_group_attention(query, kv_cache, output, meta, key_width, head_size, scale):
    """The package's Triton kernel: `query [T, np, >= nc*hn]` (the mixed queries `q~_h` in the
    first `nc*hn`) -> `output [T, np, nc*hn]`, `p_h @ [V_0 ... V_nc-1]` (the batch's tokens;
    padding left alone)."""
    from megatron_mea.ops.paged_attention import paged_attention

    keys, values, scales = cache_views(kv_cache, key_width, head_size)
    return paged_attention(query[..., :key_width], keys, values, output, meta.query_start_loc,
                           meta.seq_lens_tensor, meta.block_table, meta.max_query_len, scale,
                           key_scales=scales, split=meta.split)


def stock_unified_attention(query, kv_cache, output, meta, key_width, head_size, scale):
    """vLLM's `unified_attention` on stride-0 K/V heads (module docstring); same arguments as
    `scale_group_attention`. Needs vLLM."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    keys, values, scales = cache_views(kv_cache, key_width, head_size)
    groups = scales.shape[-1]
    keys = keys.expand(-1, -1, groups, -1)
    values = values.expand(-1, -1, groups, -1)
    unit = torch.ones((), dtype=scales.dtype, device=scales.device).expand(scales.shape)
    split = meta.split
    unified_attention(
        q=query[..., :key_width], k=keys, v=values, out=output,
        cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
        seqused_k=meta.seq_lens_tensor, max_seqlen_k=meta.max_seq_len, softmax_scale=scale,
        causal=True, window_size=(-1, -1), block_table=meta.block_table, softcap=0,
        q_descale=None, k_descale=None, v_descale=None,
        seq_threshold_3D=split.max_seqs if split else None,
        num_par_softmax_segments=split.output.shape[2] if split else None,
        softmax_segm_output=split.output if split else None,
        softmax_segm_max=split.max if split else None,
        softmax_segm_expsum=split.expsum if split else None,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, k_scale_cache=scales,
        v_scale_cache=unit)
    return output
