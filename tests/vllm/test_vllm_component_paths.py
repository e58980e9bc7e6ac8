"""MEA's component-cache attention in vLLM equals attention over the composite heads: the
scaled-components backend (`scaled_cache.py`: `paged_decode` for decodes, composites rebuilt
for prefill chunks, `prefill.py`) and the plain component cache's CPU backend
(`components_cpu.py`: vLLM's C++ kernel with the query-side trick for decodes, composites for
prefill chunks), each driven as vLLM drives it (its cache writes, a batch ordered decodes first
with blocks scattered over the pool and padding slots) on decode-only, prefill-only (a first
prefill, chunks after cached tokens) and mixed batches.
"""

import types

import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from megatron_mea.integrations.vllm.attention import VLLMHeadMix
from megatron_mea.integrations.vllm.components_cpu import ComponentsImpl, plan
from megatron_mea.integrations.vllm.paged_decode import paged_decode, torch_paged_decode
from megatron_mea.integrations.vllm.prefill import GroupMix, leading_decodes
from megatron_mea.ops import cpu_decode
from megatron_mea.integrations.vllm.scaled_cache import (
    ScaledComponentsImpl,
    ScaledComponentsMetadata,
)

NP, NG, NC, HN, EPS = 8, 4, 2, 32, 1e-6
WIDTH = NC * HN
# (cached, new) per request, decodes first as vLLM orders them. A 1-token prompt is a decode;
# the 300-token one spans two of `paged_decode`'s tiles; five decodes are two of its groups.
BATCHES = {
    "decodes": [(12, 1), (0, 1), (40, 1), (299, 1), (5, 1)],
    "prefills": [(0, 9), (6, 5), (17, 20)],
    "chunk": [(6, 5)],  # alone: its components read back from one block are all it attends
    "mixed": [(12, 1), (30, 1), (0, 9), (6, 5), (33, 3)],
}
# (layout, dtype, block size): the scaled layout's prefill in fp64 takes torch's SDPA and its
# decode torch (`torch_paged_decode`), in fp32 vLLM's C++ kernel and the compiled decode; the plain
# component cache is vLLM's, read back in its "vec16" (16-token blocks) and "vec" (32) layouts.
LAYOUTS = [("scaled", torch.float64, 16), ("scaled", torch.float32, 16),
           ("components", torch.float32, 16), ("components", torch.float32, 32)]


def composite_attention(query, keys, values, key_mix, value_mix, weight, scale):
    """The reference: GQA over the composite heads of the components (RMS-normed with the
    scale `weight` for the scaled layout, `weight` None for the plain one), causal with the `s`
    queries at the last positions. `query [s, np, hn]`, `keys`, `values [S, nc, hn]`."""
    composite_keys = torch.einsum("tcd,cg->tgd", keys, key_mix)
    if weight is not None:
        composite_keys = composite_keys * torch.rsqrt(
            composite_keys.square().mean(-1, keepdim=True) + EPS) * weight
    composite_values = torch.einsum("tcd,cg->tgd", values, value_mix)
    group = torch.arange(NP) // (NP // NG)
    scores = torch.einsum("shd,thd->hst", query, composite_keys[:, group]) * scale
    s, positions = query.shape[0], keys.shape[0]
    mask = torch.ones(s, positions, dtype=torch.bool).triu(positions - s + 1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hst,thd->shd", probs, composite_values[:, group])


def layer_rows(keys, values, key_mix, weight):
    """What `VariantAttention` hands the attention per token (RoPE left out: it acts alike on
    every head): key rows (components times the k norm's scale, then the `ng` scales for the
    scaled layout) `[S, 1, C_k]` and value rows `[S, 1, nc*hn]`."""
    positions = keys.shape[0]
    if weight is None:
        rows = keys.reshape(positions, -1)
    else:
        scales = torch.rsqrt(torch.einsum("tcd,cg->tgd", keys, key_mix).square().mean(-1) + EPS)
        rows = torch.cat([(keys * weight).reshape(positions, -1), scales], -1)
    return rows[:, None], values.reshape(positions, 1, -1)


@pytest.mark.parametrize("layout,dtype,block", LAYOUTS, ids=lambda v: str(v).split(".")[-1])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_component_cache_attention_equals_attention_over_the_composite_heads(
        layout, dtype, block, batch):
    torch.manual_seed(0)
    scaled = layout == "scaled"
    head_mix = VLLMHeadMix(NC, NG).to(dtype)
    torch.nn.init.normal_(head_mix.key_weight)
    torch.nn.init.normal_(head_mix.value_weight)
    key_mix, value_mix = head_mix.key_weight.detach(), head_mix.value_weight.detach()
    weight = 1 + 0.3 * torch.randn(HN, dtype=dtype) if scaled else None
    scale = HN**-0.5
    head_size = WIDTH + NG if scaled else WIDTH
    if scaled:
        impl = ScaledComponentsImpl(NP, head_size, scale, 1, num_scales=NG, head_dim=HN,
                                    head_mix=head_mix)
        layer = None
    else:
        impl = ComponentsImpl(NP, head_size, scale, 1, head_dim=HN, head_mix=head_mix,
                              num_groups=NG)
        layer = types.SimpleNamespace(isa=_get_attn_isa(dtype, block, WIDTH),
                                      _k_scale_float=1.0, _v_scale_float=1.0)
    cached, new = zip(*BATCHES[batch])
    lengths = [c + n for c, n in zip(cached, new)]
    counts = [-(-length // block) for length in lengths]
    num_blocks = sum(counts) + 3
    # vLLM's CPU layout `[blocks, 1, bs, keys then values]`; unwritten slots hold NaN (the
    # stock kernel multiplies the tail of a block by zero, so its cache starts at zero).
    kv_cache = torch.full((num_blocks, 1, block, head_size + WIDTH),
                          float("nan") if scaled else 0.0, dtype=dtype)
    block_ids = torch.randperm(num_blocks)  # requests' blocks scattered over the pool
    block_table = torch.zeros(len(lengths), max(counts) + 2, dtype=torch.int32)
    used = 0
    for request, count in enumerate(counts):
        block_table[request, :count] = block_ids[used:used + count]
        used += count

    def slots(request, positions):
        return block_table[request, positions // block].long() * block + positions % block

    data = [(torch.randn(length, NP, HN, dtype=dtype), torch.randn(length, NC, HN, dtype=dtype),
             torch.randn(length, NC, HN, dtype=dtype)) for length in lengths]
    queries, key_rows, value_rows, slot_list = [], [], [], []
    for request, (query, keys, values) in enumerate(data):
        rows, value_row = layer_rows(keys, values, key_mix, weight)
        past = torch.arange(cached[request])
        impl.do_kv_cache_update(layer, rows[past], value_row[past], kv_cache,
                                slots(request, past))
        step = torch.arange(cached[request], lengths[request])
        # The plain query in the first hn of the head; the rest is not read.
        queries.append(torch.nn.functional.pad(query[step], (0, head_size - HN),
                                               value=float("nan")))
        key_rows.append(rows[step])
        value_rows.append(value_row[step])
        slot_list.append(slots(request, step))
    padding = 2  # a padded batch: slots -1, outputs left alone
    query = torch.cat(queries + [torch.zeros(padding, NP, head_size, dtype=dtype)])
    slot_mapping = torch.cat(slot_list + [torch.full((padding,), -1)])
    key = torch.cat(key_rows + [torch.zeros(padding, 1, head_size, dtype=dtype)])
    value = torch.cat(value_rows + [torch.zeros(padding, 1, WIDTH, dtype=dtype)])
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    starts = [0]
    for count in new:
        starts.append(starts[-1] + count)
    if scaled:
        meta = ScaledComponentsMetadata(
            num_actual_tokens=starts[-1], query_starts=starts, seq_lens=lengths,
            block_table=block_table, slot_mapping=slot_mapping,
            num_decodes=leading_decodes(starts))
    else:
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lengths, dtype=torch.int32), num_reqs=len(lengths),
            num_actual_tokens=starts[-1], max_query_len=max(new), max_seq_len=max(lengths),
            block_table_tensor=block_table, slot_mapping=slot_mapping)
        meta = plan(common, layer.isa, NP, head_size, dtype)
        assert meta.trick_requests == leading_decodes(starts)  # a layout read back
    output = torch.zeros(query.shape[0], NP, WIDTH, dtype=dtype)
    threads = torch.get_num_threads()
    impl.forward(layer, query, key, value, kv_cache, meta, output)
    # `paged_decode` runs on one thread and hands the engine's count back.
    assert torch.get_num_threads() == threads

    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    for request, (query_all, keys, values) in enumerate(data):
        got = output[starts[request]:starts[request + 1], :, :HN]
        want = composite_attention(query_all[cached[request]:], keys, values, key_mix,
                                   value_mix, weight, scale)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert not output[starts[-1]:].any()


def test_torch_decode_equals_the_compiled_one():
    """The scaled layout's two CPU decodes agree in fp32: `paged_decode` takes the compiled loop
    (the tier's machines have a C compiler), and the torch tiles and request groups (here
    32-token tiles in groups of 2) with the mixes around them give the same outputs. (In bf16
    the torch path's GEMMs round to bf16; the compiled loop's bf16 reads are held to fp64
    attention in tests/test_cpu_decode.py.)"""
    torch.manual_seed(0)
    block, lengths = 16, [299, 40, 12, 5, 1]
    counts = [-(-length // block) for length in lengths]
    kv_cache = torch.randn(sum(counts) + 2, 1, block, 2 * WIDTH + NG)
    kv_cache[..., WIDTH:WIDTH + NG] = kv_cache[..., WIDTH:WIDTH + NG].abs() + 0.5
    block_ids = torch.randperm(kv_cache.shape[0])
    block_table = torch.zeros(len(lengths), max(counts), dtype=torch.int32)
    used = 0
    for request, count in enumerate(counts):
        block_table[request, :count] = block_ids[used:used + count]
        used += count
    head_mix = VLLMHeadMix(NC, NG)
    torch.nn.init.normal_(head_mix.key_weight)
    torch.nn.init.normal_(head_mix.value_weight)
    mix = GroupMix.of(head_mix, 0, NG, NP)
    query = torch.randn(len(lengths), NP, HN)
    scale = HN**-0.5

    assert cpu_decode.supports(kv_cache, WIDTH) and cpu_decode.load() is not None
    compiled = paged_decode(query, mix, kv_cache, block_table, lengths, NG, scale)
    tiles = torch_paged_decode(mix.mix_queries(query), kv_cache, block_table, lengths, NG, scale,
                               tile_tokens=32, gather_rows=64)
    torch.testing.assert_close(compiled, mix.mix_outputs(tiles), rtol=2e-5, atol=2e-5)
