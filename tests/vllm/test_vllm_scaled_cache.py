"""MEA's scaled-components cache in vLLM (`integrations/vllm/scaled_cache.py`): the paged attention
equals attention over the composite heads, and a Qwen3 export (RMS q/k norm, `nc = ng/2`) served
through vLLM's paged cache (small blocks, chunked prefill, requests of different lengths in one
batch, a second round from the prefix cache) generates the Hugging Face model's greedy tokens.
"""

import pytest
import torch

from megatron_mea.integrations.vllm.scaled_cache import (
    ScaledComponentsImpl,
    ScaledComponentsMetadata,
)
from tests.vllm.test_vllm_serving import hf_greedy, serve

NP, NG, NC, HN, EPS = 8, 4, 2, 16, 1e-6
BLOCK = 4


def composite_attention(query, keys, values, key_mix, value_mix, weight, scale):
    """The reference: GQA over the RMS-normed composite heads of the components, causal with the
    `s` queries at the last positions. `query [s, np, hn]`, `keys`, `values [S, nc, hn]`."""
    mixed = torch.einsum("tcd,cg->tgd", keys, key_mix)
    composite_keys = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + EPS) * weight
    composite_values = torch.einsum("tcd,cg->tgd", values, value_mix)
    group = torch.arange(NP) // (NP // NG)
    scores = torch.einsum("shd,thd->hst", query, composite_keys[:, group]) * scale
    s, positions = query.shape[0], keys.shape[0]
    mask = torch.ones(s, positions, dtype=torch.bool).triu(positions - s + 1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hst,thd->shd", probs, composite_values[:, group])


def cache_entries(query, keys, values, key_mix, weight):
    """What `VariantAttention` hands the layer (RoPE left out: it acts alike on every head):
    padded mixed queries `[s, np, nc*hn + ng]`, key rows `[S, 1, nc*hn + ng]`, value rows."""
    scales = torch.rsqrt(torch.einsum("tcd,cg->tgd", keys, key_mix).square().mean(-1) + EPS)
    group = torch.arange(NP) // (NP // NG)
    mixed = torch.einsum("shd,ch->shcd", query, key_mix[:, group]).reshape(query.shape[0], NP, -1)
    padded = torch.nn.functional.pad(mixed, (0, NG))
    rows = torch.cat([(keys * weight).reshape(keys.shape[0], -1), scales], -1)
    return padded, rows[:, None], values.reshape(values.shape[0], 1, -1)


def test_paged_attention_with_scales_equals_attention_over_the_composite_heads():
    torch.manual_seed(0)
    dtype = torch.float64
    key_mix, value_mix = torch.randn(NC, NG, dtype=dtype), torch.randn(NC, NG, dtype=dtype)
    weight = 1 + 0.3 * torch.randn(HN, dtype=dtype)
    scale = HN**-0.5
    impl = ScaledComponentsImpl(NP, NC * HN + NG, scale, 1, num_scales=NG)
    # Three requests: a decode step after 12 cached, a chunk of 5 after 6, a first prefill of 9.
    cached, new = [12, 6, 0], [1, 5, 9]
    lengths = [c + n for c, n in zip(cached, new)]
    num_blocks = 16
    kv_cache = torch.full((num_blocks, 1, BLOCK, 2 * NC * HN + NG), float("nan"), dtype=dtype)
    block_ids = torch.randperm(num_blocks)  # requests' blocks scattered over the pool
    block_table = torch.zeros(3, 8, dtype=torch.long)
    used = 0
    for request, length in enumerate(lengths):
        count = -(-length // BLOCK)
        block_table[request, :count] = block_ids[used:used + count]
        used += count

    def slots(request, positions):
        return block_table[request, positions // BLOCK] * BLOCK + positions % BLOCK

    data = [(torch.randn(length, NP, HN, dtype=dtype), torch.randn(length, NC, HN, dtype=dtype),
             torch.randn(length, NC, HN, dtype=dtype)) for length in lengths]
    queries, key_rows, value_rows, slot_list = [], [], [], []
    for request, (query, keys, values) in enumerate(data):
        padded, rows, value_row = cache_entries(query, keys, values, key_mix, weight)
        past = torch.arange(cached[request])
        impl.do_kv_cache_update(None, rows[past], value_row[past], kv_cache, slots(request, past))
        step = torch.arange(cached[request], lengths[request])
        queries.append(padded[step])
        key_rows.append(rows[step])
        value_rows.append(value_row[step])
        slot_list.append(slots(request, step))
    padding = 2  # a padded batch: slots -1, outputs left alone
    query = torch.cat(queries + [torch.zeros(padding, NP, NC * HN + NG, dtype=dtype)])
    slot_mapping = torch.cat(slot_list + [torch.full((padding,), -1)])
    key = torch.cat(key_rows + [torch.zeros(padding, 1, NC * HN + NG, dtype=dtype)])
    value = torch.cat(value_rows + [torch.zeros(padding, 1, NC * HN, dtype=dtype)])
    impl.do_kv_cache_update(None, key, value, kv_cache, slot_mapping)
    starts = [0]
    for count in new:
        starts.append(starts[-1] + count)
    meta = ScaledComponentsMetadata(num_actual_tokens=starts[-1], query_starts=starts,
                                    seq_lens=lengths, block_table=block_table,
                                    slot_mapping=slot_mapping)
    output = torch.zeros(query.shape[0], NP, NC * HN, dtype=dtype)
    impl.forward(None, query, key, value, kv_cache, meta, output)

    for request, (query_all, keys, values) in enumerate(data):
        got = output[starts[request]:starts[request + 1]].view(-1, NP, NC, HN)
        got = torch.einsum("shcd,ch->shd", got, value_mix[:, torch.arange(NP) // (NP // NG)])
        want = composite_attention(query_all[cached[request]:], keys, values, key_mix,
                                   value_mix, weight, scale)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert not output[starts[-1]:].any()


# Long prompts sharing a 40-token prefix (several 16-token blocks) and one short prompt: 16
# tokens per step split every prompt into chunks and mix decodes of one request with prefill
# chunks of another.
PREFIX = [(7 * i + 3) % 128 for i in range(40)]
PAGED_PROMPTS = [PREFIX + [5, 17, 33, 2, 90], PREFIX + [100, 3, 3, 47, 120, 8, 77, 21, 9, 54],
                 [42, 11, 64], [(11 * i + 5) % 128 for i in range(70)]]
PAGED_ENGINE = {"block_size": 16, "max_num_batched_tokens": 16, "max_num_seqs": 4,
                "enable_chunked_prefill": True, "enable_prefix_caching": True}


@pytest.fixture(scope="module")
def served_paged(tmp_path_factory):
    return serve(["qwen3-mea-nc2"], tmp_path_factory.mktemp("vllm") / "paged.json",
                 prompts=PAGED_PROMPTS, llm_args=PAGED_ENGINE, rounds=2)["qwen3-mea-nc2"]


def test_scaled_components_on_small_blocks_chunked_and_prefix_cached_give_hf_tokens(
        served_paged):
    want = hf_greedy("qwen3-mea-nc2", PAGED_PROMPTS)
    first, second = served_paged["rounds"]
    assert first["tokens"] == want
    assert second["tokens"] == want
    # The second round read the shared blocks from the prefix cache.
    assert all(count >= 32 for count in second["cached_tokens"][:2]), second["cached_tokens"]
