"""`core_attention="sdpa"` equals Megatron's local DotProductAttention: outputs and gradients of
the core attention alone (MHA, GQA, MQA, odd sizes, masks, windows, decode steps), of whole
layers of every variant, and of a GPT at TP=2 with sequence parallelism (real gloo processes)."""

import dataclasses

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module

from megatron_mea import MEATransformerConfig, get_gpt_decoder_block_spec, get_gpt_layer_spec
from megatron_mea.layers.sdpa_attention import SDPA_HAS_GQA, SDPADotProductAttention
from megatron_mea.specs import apply_core_attention
from tests._dist import run_distributed
from tests._models import CPU_EXACT, VOCAB, batch, forward_loss, init_parallel, tiny_config

# fp32 rounding of two summation orders; the values are O(1).
ATOL = 2e-5


def _config(num_heads, num_groups, head_dim, **fields):
    return MEATransformerConfig(
        num_layers=1,
        hidden_size=num_heads * head_dim,
        kv_channels=head_dim,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        **CPU_EXACT,
        **fields,
    )


def _pair(config, mask_type=AttnMaskType.causal, **kwargs):
    args = dict(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")
    return DotProductAttention(**args, **kwargs), SDPADotProductAttention(**args, **kwargs)


def _inputs(sq, sk, b, num_heads, num_groups, head_dim, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # views with gaps, as the variants hand over (e.g. split of linear_qkv's output)
        wide = torch.randn(sq, b, num_heads, head_dim + 3, generator=gen)
        query = wide[..., 1 : head_dim + 1]
    else:
        query = torch.randn(sq, b, num_heads, head_dim, generator=gen)
    key = torch.randn(sk, b, num_groups, head_dim, generator=gen)
    value = torch.randn(sk, b, num_groups, head_dim, generator=gen)
    grad = torch.randn(sq, b, num_heads * head_dim, generator=gen)
    return query, key, value, grad


def _run(module, query, key, value, grad, mask=None):
    leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    out = module(*leaves, attention_mask=mask)
    out.backward(grad)
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_same(a, b, atol=ATOL):
    out_a, grads_a = a
    out_b, grads_b = b
    assert out_a.shape == out_b.shape
    torch.testing.assert_close(out_b, out_a, atol=atol, rtol=1e-5)
    for name, ga, gb in zip("qkv", grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=atol, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


# (id, np, ng, hn, sq, b): MHA, GQA, MQA, odd sizes, a batch.
SHAPES = [
    ("mha", 4, 4, 8, 16, 1),
    ("gqa", 8, 2, 16, 32, 2),
    ("mqa", 4, 1, 8, 12, 1),
    ("gqa-odd", 6, 3, 6, 13, 3),
    ("gqa-odd-rep5", 5, 1, 7, 9, 2),
]


@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_causal_forward_and_backward_equal_megatrons(single_rank, case, strided):
    _, num_heads, num_groups, head_dim, seq, b = case
    megatron, sdpa = _pair(_config(num_heads, num_groups, head_dim))
    tensors = _inputs(seq, seq, b, num_heads, num_groups, head_dim, strided=strided)
    _assert_same(_run(megatron, *tensors), _run(sdpa, *tensors))


def test_explicit_padding_mask_equals_megatrons(single_rank):
    num_heads, num_groups, head_dim, seq, b = 6, 2, 8, 11, 2
    megatron, sdpa = _pair(_config(num_heads, num_groups, head_dim), AttnMaskType.padding)
    # True = masked (Megatron's convention): causal plus the last 3 keys of the second sequence;
    # every query row keeps at least one key.
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).repeat(b, 1, 1, 1)
    mask[1, :, 4:, -3:] = True
    tensors = _inputs(seq, seq, b, num_heads, num_groups, head_dim)
    _assert_same(_run(megatron, *tensors, mask=mask), _run(sdpa, *tensors, mask=mask))


def test_decode_step_attends_to_the_whole_cache(single_rank):
    # sq = 1 with a longer key (a KV-cache step): no mask in Megatron's causal softmax either.
    megatron, sdpa = _pair(_config(8, 4, 8))
    tensors = _inputs(1, 9, 2, 8, 4, 8)
    _assert_same(_run(megatron, *tensors), _run(sdpa, *tensors))


def test_sliding_window_equals_megatrons(single_rank):
    config = _config(4, 2, 8, window_size=(3, 0))
    megatron, sdpa = _pair(config)
    tensors = _inputs(10, 10, 1, 4, 2, 8)
    _assert_same(_run(megatron, *tensors), _run(sdpa, *tensors))


@pytest.mark.parametrize(
    "fields,kwargs",
    [
        (dict(apply_query_key_layer_scaling=True, fp16=False), {}),
        ({}, dict(softmax_scale=0.37)),
    ],
    ids=["layer-scaling", "softmax-scale"],
)
def test_scales_equal_megatrons(single_rank, fields, kwargs):
    config = _config(4, 2, 8, **fields)
    args = dict(config=config, attn_mask_type=AttnMaskType.causal, attention_type="self", **kwargs)
    megatron = DotProductAttention(layer_number=3, **args)
    sdpa = SDPADotProductAttention(layer_number=3, **args)
    tensors = _inputs(8, 8, 1, 4, 2, 8)
    _assert_same(_run(megatron, *tensors), _run(sdpa, *tensors))


def test_gqa_does_not_repeat_key_value(single_rank, monkeypatch):
    if not SDPA_HAS_GQA:
        pytest.skip("torch < 2.5 has no enable_gqa")

    def refuse(*args, **kwargs):
        raise AssertionError("K/V were repeated")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    _, sdpa = _pair(_config(8, 2, 8))
    _run(sdpa, *_inputs(6, 6, 1, 8, 2, 8))


def test_refusals(single_rank):
    config = _config(4, 2, 8)
    _, sdpa = _pair(config)
    query, key, value, _ = _inputs(4, 4, 1, 4, 2, 8)
    with pytest.raises(ValueError, match="attention_bias"):
        sdpa(query, key, value, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="packed"):
        sdpa(query, key, value, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="sq=4 != sk=6"):
        sdpa(query, *_inputs(4, 6, 1, 4, 2, 8)[1:3], None)
    with pytest.raises(ValueError, match="softmax_type"):
        _pair(dataclasses.replace(config, softmax_type="off-by-one"))


# ---- whole layers and specs ---------------------------------------------------------------------

LAYER_VARIANTS = [
    ("standard", {}),
    ("mea-virtual", dict(attention_variant="mea", mea_num_kv_components=2, mea_mix_init="normal")),
    ("mea-weights", dict(attention_variant="mea", mea_mix_init="normal",
                         mea_tp_exchange="weights")),
    ("kha-linear-folded", dict(attention_variant="kha", kha_variant="linear",
                               kha_fold_linear=True)),
    ("kha-mlp", dict(attention_variant="kha", kha_variant="mlp")),
]


def _layer_step(config, core_attention, seq=12, b=2, seed=5):
    torch.manual_seed(seed)
    spec = get_gpt_layer_spec(config, use_transformer_engine=False, core_attention=core_attention)
    layer = build_module(spec, config=config, layer_number=1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, b, config.hidden_size, generator=gen).requires_grad_()
    rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(seq)
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=rotary)
    out.backward(torch.randn(out.shape, generator=gen))
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return layer, out.detach(), x.grad, grads


@pytest.mark.parametrize("name,fields", LAYER_VARIANTS, ids=[v[0] for v in LAYER_VARIANTS])
def test_layer_with_sdpa_equals_layer_with_megatrons_core_attention(single_rank, name, fields):
    config = tiny_config(moe=False, num_layers=1, **fields)
    _, out_m, dx_m, grads_m = _layer_step(config, "megatron")
    layer, out_s, dx_s, grads_s = _layer_step(config, "sdpa")
    assert isinstance(layer.self_attention.core_attention, SDPADotProductAttention)
    torch.testing.assert_close(out_s, out_m, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(dx_s, dx_m, atol=ATOL, rtol=1e-5)
    assert grads_s.keys() == grads_m.keys()
    for key in grads_m:
        torch.testing.assert_close(grads_s[key], grads_m[key], atol=ATOL, rtol=1e-5, msg=key)


def test_sdpa_spec_swaps_only_the_core_attention_and_keeps_sharing(single_rank):
    config = tiny_config("mea", num_layers=4, moe_layer_freq=[0, 1, 0, 1])
    ours = get_gpt_decoder_block_spec(config, use_transformer_engine=False, core_attention="sdpa")
    stock = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for mine, theirs in zip(ours.layer_specs, stock.layer_specs):
        attention = mine.submodules.self_attention
        stock_attention = theirs.submodules.self_attention
        assert attention.module is stock_attention.module
        assert attention.submodules.core_attention is SDPADotProductAttention
        assert stock_attention.submodules.core_attention is DotProductAttention
        assert dataclasses.replace(attention.submodules, core_attention=DotProductAttention) == (
            stock_attention.submodules
        )
    # Layers that shared a spec still share one; the default spec is untouched.
    assert ours.layer_specs[0] is ours.layer_specs[2]
    assert ours.layer_specs[1] is ours.layer_specs[3]
    assert apply_core_attention(stock, "megatron") is stock


def test_core_attention_choices_are_checked():
    config = tiny_config("kha")
    with pytest.raises(ValueError, match="core_attention must be one of"):
        get_gpt_layer_spec(config, use_transformer_engine=False, core_attention="flash")
    with pytest.raises(ValueError, match="local spec only"):
        get_gpt_layer_spec(config, use_transformer_engine=True, core_attention="sdpa")
    with pytest.raises(ValueError, match="local spec only"):
        get_gpt_decoder_block_spec(config, use_transformer_engine=True, core_attention="sdpa")


# ---- TP=2 with sequence parallelism --------------------------------------------------------------

TP_VARIANTS = [
    ("standard", {}),
    ("mea-activations", dict(variant="mea", mea_mix_init="normal")),
    ("mea-virtual-weights", dict(variant="mea", mea_num_kv_components=2, mea_mix_init="normal",
                                 mea_tp_exchange="weights")),
    ("kha-mlp", dict(variant="kha", kha_variant="mlp")),
]


def _gpt(config, core_attention):
    torch.manual_seed(1234)  # use_cpu_initialization: every rank builds the same master weights
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      core_attention=core_attention)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=64, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _tp_worker(rank, world_size, variants):
    """Per variant: this rank's max |difference| of losses and of every local gradient between
    the two core attentions, and the gradient scale."""
    init_parallel(tp=world_size)
    tokens, labels = batch(num_sequences=2)
    results = {}
    for name, fields in variants:
        runs = {}
        for core_attention in ("megatron", "sdpa"):
            config = tiny_config(tp=world_size, sp=True, moe=False, **fields)
            model = _gpt(config, core_attention)
            losses = forward_loss(model, tokens, labels)
            losses.mean().backward()
            runs[core_attention] = (losses.detach(),
                                    {n: p.grad.clone() for n, p in model.named_parameters()})
        (loss_m, grads_m), (loss_s, grads_s) = runs["megatron"], runs["sdpa"]
        results[name] = dict(
            loss_diff=(loss_m - loss_s).abs().max().item(),
            grad_diff=max((grads_m[n] - grads_s[n]).abs().max().item() for n in grads_m),
            grad_scale=max(g.abs().max().item() for g in grads_m.values()),
            same_names=grads_m.keys() == grads_s.keys(),
        )
    return results


@pytest.mark.slow
def test_sdpa_equals_megatrons_core_attention_at_tp2_with_sp():
    results = run_distributed(_tp_worker, 2, TP_VARIANTS)
    for rank, per_rank in enumerate(results):
        for name, row in per_rank.items():
            assert row["same_names"], (rank, name)
            assert row["loss_diff"] < 1e-5, (rank, name, row)
            assert row["grad_diff"] < 1e-5 * max(1.0, row["grad_scale"]), (rank, name, row)
