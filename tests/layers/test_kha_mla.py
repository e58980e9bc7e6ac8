"""KHA-Linear on Megatron's MLA: identity at init, placement (content channels, folds into the
up-projections), parameters, spec swap and the config's refusals. Single process, CPU."""

import pytest
import torch
from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mea import get_gpt_decoder_block_spec, get_gpt_layer_spec
from megatron_mea.layers.kha_mla import (
    KHAMLASelfAttention,
    MEAMLATransformerConfig,
    MLASDPADotProductAttention,
)
from megatron_mea.specs import apply_attention_variant
from tests._models import batch, forward_loss
from tests.distributed._mla_workers import MLA_SIZES, build_mla_gpt, mla_config

DC, DV = MLA_SIZES["qk_head_dim"], MLA_SIZES["v_head_dim"]

SHAPES = [
    pytest.param({}, id="q-latent-rope"),
    # No query latent (linear_q_proj; no latent norms, which megatron-core 0.19 refuses
    # without a query latent) and YaRN RoPE (mscale in the softmax scale and the rotary).
    pytest.param(
        dict(q_lora_rank=None, qk_layernorm=False, rope_type="yarn", rotary_scaling_factor=4.0,
             original_max_position_embeddings=4, mscale=0.7, mscale_all_dim=0.5),
        id="q-proj-yarn",
    ),
]


def _losses_and_grads(model):
    tokens, labels = batch(num_sequences=2)
    losses = forward_loss(model, tokens, labels)
    losses.mean().backward()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}


def _plain_and_kha(**overrides):
    """A plain MLA model and a KHA-MLA model holding the same Megatron weights."""
    plain = build_mla_gpt(mla_config("standard", **overrides))
    kha = build_mla_gpt(mla_config("kha", **overrides))
    missing, unexpected = kha.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".knock." in key for key in missing)
    return plain, kha


@pytest.mark.parametrize("overrides", SHAPES)
def test_kha_mla_at_init_equals_plain_mla_exactly(single_rank, overrides):
    plain, kha = _plain_and_kha(**overrides)
    plain_losses, plain_grads = _losses_and_grads(plain)
    kha_losses, kha_grads = _losses_and_grads(kha)
    assert torch.equal(kha_losses, plain_losses)
    for name, grad in plain_grads.items():
        assert torch.equal(kha_grads[name], grad), name
    knock = [n for n in kha_grads if ".knock." in n]
    assert len(knock) == 2 * 3 and all(kha_grads[n].abs().sum() > 0 for n in knock)


def _fold_into_up_projections(plain, kha):
    """Plain MLA weights with each layer's KHA matrices folded into its up-projection rows
    (`W_h' = T^T W_h` on the content rows of q and k, on the v rows): what KHA on the content
    channels must equal, RoPE channels untouched."""
    with torch.no_grad():
        for plain_layer, kha_layer in zip(plain.decoder.layers, kha.decoder.layers):
            attention, knock = plain_layer.self_attention, kha_layer.self_attention.knock
            q_proj = getattr(attention, "linear_q_up_proj", None) or attention.linear_q_proj
            heads = attention.num_attention_heads_per_partition
            q = q_proj.weight.view(heads, -1, q_proj.weight.shape[-1])
            q[:, :DC] = torch.einsum("dc,hdi->hci", knock.q_weight, q[:, :DC].clone())
            kv_weight = attention.linear_kv_up_proj.weight
            kv = kv_weight.view(heads, DC + DV, kv_weight.shape[-1])
            kv[:, :DC] = torch.einsum("dc,hdi->hci", knock.k_weight, kv[:, :DC].clone())
            kv[:, DC:] = torch.einsum("dc,hdi->hci", knock.v_weight, kv[:, DC:].clone())


@pytest.mark.parametrize("overrides", SHAPES)
def test_kha_mla_equals_plain_mla_with_matrices_folded_into_up_projections(
    single_rank, overrides
):
    plain, kha = _plain_and_kha(**overrides)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in kha.named_parameters():
            if ".knock." in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    _fold_into_up_projections(plain, kha)
    tokens, labels = batch(num_sequences=2)
    with torch.no_grad():
        folded, knocked = forward_loss(plain, tokens, labels), forward_loss(kha, tokens, labels)
    torch.testing.assert_close(knocked, folded, rtol=1e-5, atol=1e-5)
    # The matrices really moved the model (the check is not vacuous).
    with torch.no_grad():
        plain_again = build_mla_gpt(mla_config("standard", **overrides))
        assert (forward_loss(plain_again, tokens, labels) - knocked).abs().max() > 1e-3


@pytest.mark.parametrize(
    "targets,expected",
    [
        (None, {"q_weight": (DC, DC), "k_weight": (DC, DC), "v_weight": (DV, DV)}),
        (("v",), {"v_weight": (DV, DV)}),
        (("k", "q"), {"q_weight": (DC, DC), "k_weight": (DC, DC)}),
    ],
    ids=["qkv", "v", "qk"],
)
def test_knock_matrices_are_content_and_value_sized_identities(single_rank, targets, expected):
    model = build_mla_gpt(mla_config(kha_targets=targets) if targets else mla_config())
    for layer in model.decoder.layers:
        attention = layer.self_attention
        assert type(attention) is KHAMLASelfAttention
        assert isinstance(attention.core_attention, MLASDPADotProductAttention)
        params = dict(attention.knock.named_parameters())
        assert {n: tuple(p.shape) for n, p in params.items()} == expected
        for param in params.values():
            assert torch.equal(param, torch.eye(param.shape[0]))


def test_spec_swaps_mla_for_kha_mla_and_keeps_its_submodules():
    config = mla_config(moe=False)
    spec = get_gpt_layer_spec(config, use_transformer_engine=False, core_attention="sdpa")
    attention = spec.submodules.self_attention
    assert attention.module is KHAMLASelfAttention
    assert attention.submodules.core_attention is MLASDPADotProductAttention
    assert isinstance(attention.submodules, mcore_mla.MLASelfAttentionSubmodules)
    # Duplicated down-projections (not Megatron's local ColumnParallelLinear): see
    # specs.apply_local_mla_down_projections; the TP tests fail without them.
    assert attention.submodules.linear_q_down_proj is DuplicatedLinear
    assert attention.submodules.linear_kv_down_proj is DuplicatedLinear
    assert apply_attention_variant(spec, config) == spec  # idempotent
    plain = get_gpt_layer_spec(
        mla_config("standard", moe=False), use_transformer_engine=False, core_attention="sdpa"
    )
    assert plain.submodules.self_attention.module is mcore_mla.MLASelfAttention


def test_mla_on_the_local_spec_needs_the_sdpa_core_attention():
    with pytest.raises(ValueError, match="needs core_attention='sdpa'.*DotProductAttention"):
        get_gpt_decoder_block_spec(mla_config(), use_transformer_engine=False)


@pytest.mark.skipif(
    not hasattr(mcore_mla, "FusedMLASelfAttention"), reason="megatron-core before 0.19"
)
def test_fused_mla_attention_is_refused_by_name():
    layer = get_gpt_layer_spec(
        mla_config("standard", moe=False), use_transformer_engine=False, core_attention="sdpa"
    )
    attention = layer.submodules.self_attention
    fused = ModuleSpec(
        module=mcore_mla.FusedMLASelfAttention,
        params=attention.params,
        submodules=attention.submodules,
    )
    layer.submodules.self_attention = fused
    with pytest.raises(ValueError, match="FusedMLASelfAttention"):
        apply_attention_variant(layer, mla_config(moe=False))


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(attention_variant="mea"), r"multi_latent_attention=True is not supported with "
         r"attention_variant='mea': MEA composes"),
        (dict(attention_variant="kha", kha_variant="mlp"), r"needs kha_variant='linear'.*"
         r"got 'mlp'\).*only the linear variant works on MLA.*cannot fold"),
        (dict(attention_variant="kha", kha_variant="linear", kha_fold_linear=True),
         r"kha_fold_linear=True is not supported with multi_latent_attention.*linear_qkv"),
        (dict(attention_variant="kha", kha_variant="linear", cache_mla_latents=True),
         r"cache_mla_latents=True is not supported with attention_variant='kha'"),
        (dict(attention_variant="kha", kha_variant="linear", tensor_model_parallel_size=2),
         r"tensor_model_parallel_size \(2\) > 1 needs sequence_parallel=True"),
    ],
    ids=["mea", "kha-mlp", "kha-fold-linear", "cache-mla-latents",
         "tp-without-sp"],
)
def test_config_refuses_what_does_not_work_on_mla(fields, match):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, **MLA_SIZES)
    with pytest.raises(ValueError, match=match):
        MEAMLATransformerConfig(**base, **fields)


def test_kha_on_mla_defaults_to_linear_also_for_moe():
    # Off MLA, MoE models default to KHA-MLP, which MLA cannot take.
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, **MLA_SIZES)
    config = MEAMLATransformerConfig(**base, attention_variant="kha", num_moe_experts=4,
                                     moe_router_topk=2)
    assert config.kha_variant == "linear"


def test_config_accepts_kha_linear_on_mla_including_moe():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, **MLA_SIZES)
    config = MEAMLATransformerConfig(
        **base, attention_variant="kha", kha_variant="linear", num_moe_experts=4, moe_router_topk=2
    )
    assert config.multi_latent_attention and config.kha_targets == ("q", "k", "v")
