"""Folded projections at TP=1 (MEA's `weights` exchange, KHA-Linear with `kha_fold_linear`) against
the unfolded layers: the per-step fold cache, its missed-flush guard, and the communication
formulas behind `auto`."""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module

from megatron_mea import MEATransformerConfig, get_gpt_layer_spec
from megatron_mea.layers import FoldCache, enable_fold_cache, flush_fold_caches
from megatron_mea.parallel import (
    ExchangeShape,
    activation_exchange_elements,
    choose_exchange,
    weight_exchange_elements,
)
from tests._models import CPU_EXACT, perturb_plugin_params

SEQ, BATCH, HEAD_DIM = 6, 2, 8


def _attention(exchange=None, **fields):
    if exchange is not None:
        fields.update(attention_variant="mea", mea_mix_init="normal", mea_tp_exchange=exchange)
    config = MEATransformerConfig(
        num_layers=1, hidden_size=40, kv_channels=HEAD_DIM, num_attention_heads=8,
        num_query_groups=4, normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        layernorm_epsilon=1e-5, **CPU_EXACT, **fields,
    )
    spec = get_gpt_layer_spec(config, use_transformer_engine=False)
    torch.manual_seed(0)
    attention = build_module(spec.submodules.self_attention, config=config, layer_number=1)
    perturb_plugin_params(attention)
    return attention


def _micro_batches(attention, inputs):
    """Forward + backward of each micro-batch, as a training schedule would; returns outputs."""
    rotary = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0)(SEQ)
    outputs = []
    for x in inputs:
        out, _ = attention(x, attention_mask=None, rotary_pos_emb=rotary)
        out.pow(2).mean().backward()
        outputs.append(out.detach())
    return outputs


KHA = dict(attention_variant="kha", kha_variant="linear")
# (unfolded layer, folded layer, the module whose `fold` builds the weight)
PAIRS = {
    "mea-nc=ng": (dict(exchange="activations"), dict(exchange="weights"), "head_mix"),
    "mea-virtual-bias": (
        dict(exchange="activations", mea_num_kv_components=2, add_qkv_bias=True),
        dict(exchange="weights", mea_num_kv_components=2, add_qkv_bias=True),
        "head_mix",
    ),
    "kha-linear-bias": (KHA | dict(add_qkv_bias=True),
                        KHA | dict(add_qkv_bias=True, kha_fold_linear=True), "knock"),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_fold_cache_over_micro_batches_equals_the_unfolded_layer(single_rank, pair):
    plain_fields, folded_fields, folder = PAIRS[pair]
    inputs = [torch.randn(SEQ, BATCH, 40) for _ in range(3)]
    mixed = _attention(**plain_fields)
    folded = _attention(**folded_fields)
    folded.load_state_dict(mixed.state_dict())
    assert enable_fold_cache(folded) == 1
    calls = []
    module = getattr(folded, folder)
    fold = module.fold
    module.fold = lambda *a: calls.append(1) or fold(*a)

    expected = _micro_batches(mixed, inputs)
    got = _micro_batches(folded, inputs)
    assert folded.fold_cache.live and len(calls) == 1  # one fold for the three micro-batches
    assert folded.linear_qkv.weight.grad is None  # held on the cached leaf until the flush
    flush_fold_caches([folded])
    assert not folded.fold_cache.live

    for out, ref in zip(got, expected):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    reference = dict(mixed.named_parameters())
    for name, param in folded.named_parameters():
        ref = reference[name].grad
        atol = 1e-5 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(param.grad, ref, rtol=1e-5, atol=atol, msg=name)


def test_step_without_flush_raises_instead_of_dropping_gradients(single_rank):
    attention = _attention("weights")
    enable_fold_cache(attention)
    _micro_batches(attention, [torch.randn(SEQ, BATCH, 40)])
    with torch.no_grad():
        attention.linear_qkv.weight.add_(0.01)  # an optimizer step that skipped the flush
    with pytest.raises(RuntimeError, match="flush_fold_caches"):
        _micro_batches(attention, [torch.randn(SEQ, BATCH, 40)])


def test_evaluation_projects_the_components_and_computes_the_same(single_rank):
    attention = _attention("weights", mea_num_kv_components=2)
    x = torch.randn(SEQ, BATCH, 40)
    rotary = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0)(SEQ)
    assert attention._use_folded_weight(x)
    train_out, _ = attention(x, attention_mask=None, rotary_pos_emb=rotary)
    attention.eval()
    assert not attention._use_folded_weight(x)
    with torch.no_grad():
        eval_out, _ = attention(x, attention_mask=None, rotary_pos_emb=rotary)
    torch.testing.assert_close(eval_out, train_out.detach(), rtol=1e-5, atol=1e-5)


def test_fold_cache_flush_without_a_fold_is_a_no_op():
    cache = FoldCache()
    cache.flush()
    assert not cache.live


def test_exchange_volumes_follow_spec_section_3():
    # hidden 1024, 16 heads, 4 groups, hn 64, TP 2; N = 2048 tokens.
    shape = ExchangeShape(num_heads=16, num_groups=4, num_components=4, head_dim=64,
                          hidden_size=1024, tp_size=2)
    # 4 all-to-alls, each (t-1)/t^2 of the K+V size (2 * N * 4 * 64 elements).
    assert activation_exchange_elements(shape, 2048) == 4 * (2 * 2048 * 4 * 64) // 4
    # all-gather + reduce-scatter of this rank's K/V rows (2 * 2 * 64 rows of 1024).
    assert weight_exchange_elements(shape) == 2 * (2 * 2 * 64 * 1024)
    assert choose_exchange(shape, 2048) == "weights"  # 524288 <= 1048576
    assert choose_exchange(shape, 512) == "activations"  # 524288 > 262144
    tp1 = ExchangeShape(16, 4, 4, 64, 1024, 1)
    assert activation_exchange_elements(tp1, 2048) == weight_exchange_elements(tp1) == 0
    assert choose_exchange(tp1, 2048) == "weights"
    # Duplicated components (nc=1 < t=4): every linear_qkv row / output feature moves.
    dup = ExchangeShape(16, 4, 1, 64, 1024, 4, bias=True)
    assert weight_exchange_elements(dup) == 2 * 3 * (16 + 2) * 64 * 1025 // 4
    assert activation_exchange_elements(dup, 100) == 2 * 100 * (16 + 2) * 64 * 3 // 4
