"""The compiled CPU decode over the scaled-components cache (`ops/cpu_decode.py`) equals plain
attention over the rows its block table names: fp32 and bf16 caches, blocks scattered over the
pool, lengths that end inside a tile and a block (1 to 299 positions; the C loop's tiles are 16),
head counts that take its 4-head and single-head dot blocks and 2- and 1-head value blocks, and a
cache whose rows are spaced wider than they are (a view, as vLLM hands a layer's cache).
"""

import logging

import pytest
import torch

from megatron_mea.ops import cpu_decode

LENGTHS = [12, 1, 40, 299, 16, 17]


def reference(query, key_mix, value_mix, kv_cache, block_table, seq_lens, num_scales, scale):
    """Each request's rows gathered whole, composite heads, softmax in fp64: `query [R, np, hn]`,
    `key_mix`, `value_mix [np, nc]` -> `[R, np, hn]`."""
    components, head_dim = key_mix.shape[1], query.shape[-1]
    width = components * head_dim
    heads_per_group = query.shape[1] // num_scales
    outputs = []
    for request, length in enumerate(seq_lens):
        rows = kv_cache[block_table[request].long(), 0].reshape(-1, kv_cache.shape[-1])[:length]
        rows = rows.double()
        keys = rows[:, :width].reshape(length, components, head_dim)
        values = rows[:, width + num_scales:].reshape(length, components, head_dim)
        scales = rows[:, width:width + num_scales].repeat_interleave(heads_per_group, dim=1)
        # Each head's composite key and value: its group's mix of the components.
        head_keys = torch.einsum("tcd,hc->htd", keys, key_mix.double())
        head_values = torch.einsum("tcd,hc->htd", values, value_mix.double())
        logits = scale * scales.T * torch.einsum("hd,htd->ht", query[request].double(),
                                                 head_keys)
        outputs.append(torch.einsum("ht,htd->hd", logits.softmax(-1), head_values))
    return torch.stack(outputs)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    built = cpu_decode.build(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "no C compiler: the tests' machines have cc"
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,groups,block", [(8, 4, 16), (6, 2, 5), (3, 1, 128)])
def test_compiled_decode_equals_attention(kernel, dtype, heads, groups, block):
    torch.manual_seed(0)
    components, head_dim = 2, 32
    width = components * head_dim
    row = 2 * width + groups
    counts = [-(-length // block) for length in LENGTHS]
    num_blocks = sum(counts) + 3
    # Rows spaced 8 values apart more than their width, NaN between and after them: what is
    # not a row of a request's positions must never be read.
    storage = torch.full((num_blocks, 1, block, row + 8), float("nan"))
    kv_cache = storage[..., :row]
    block_ids = torch.randperm(num_blocks)
    block_table = torch.zeros(len(LENGTHS), max(counts) + 1, dtype=torch.int32)
    used = 0
    for request, (length, count) in enumerate(zip(LENGTHS, counts)):
        block_table[request, :count] = block_ids[used:used + count]
        used += count
        positions = torch.arange(length)
        kv_cache[block_table[request, positions // block].long(), 0, positions % block] = \
            torch.cat([torch.randn(length, width), 0.5 + torch.rand(length, groups),
                       torch.randn(length, width)], -1)
    kv_cache = kv_cache.to(dtype)
    query = torch.randn(len(LENGTHS), heads, head_dim)
    # Each head's group's column of A_k and A_v (GQA order: heads of a group adjacent).
    group_of_head = torch.arange(heads) // (heads // groups)
    key_mix = torch.randn(components, groups).T[group_of_head]
    value_mix = torch.randn(components, groups).T[group_of_head]
    scale = 0.3

    assert cpu_decode.supports(kv_cache, width)
    got = cpu_decode.scaled_decode(kernel, query, key_mix, value_mix, kv_cache, block_table,
                                   LENGTHS, groups, scale)
    want = reference(query, key_mix, value_mix, kv_cache, block_table, LENGTHS, groups, scale)
    assert got.dtype == query.dtype
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def test_compiled_decode_refuses_lengths_outside_the_table(kernel):
    query, mix = torch.randn(2, 4, 8), torch.ones(4, 2)
    kv_cache = torch.randn(4, 1, 8, 2 * 16 + 2)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for lengths in ([0, 3], [3, 17]):
        with pytest.raises(ValueError, match="seq_lens"):
            cpu_decode.scaled_decode(kernel, query, mix, mix, kv_cache, block_table, lengths, 2,
                                     1.0)
    assert not cpu_decode.supports(kv_cache.double(), 16)  # fp64: the torch path's
    assert not cpu_decode.supports(kv_cache, 12)  # not whole 8-float vectors


def test_no_compiler_leaves_the_torch_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.build(tmp_path / "kernels") is None
    assert "could not build cpu_decode.c" in caplog.text
    assert not list((tmp_path / "kernels").iterdir())  # no partial library left behind
