"""Every configuration a user can get wrong fails at construction with a ValueError naming it."""

import logging

import pytest

from megatron_mea import MEATransformerConfig

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4)


def make(**fields):
    return MEATransformerConfig(**(BASE | fields))


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(attention_variant="mla"), r"attention_variant \('mla'\) must be one of"),
        (dict(attention_variant="kha", kha_variant="conv"), r"kha_variant \('conv'\)"),
        (dict(attention_variant="kha", kha_init="eye"), r"kha_init \('eye'\) must be one of"),
        (
            dict(attention_variant="kha", kha_variant="gate", kha_fold_linear=True),
            r"kha_fold_linear=True needs kha_variant='linear' \(got 'gate'\)",
        ),
        (dict(attention_variant="kha", kha_targets=("x",)), r"kha_targets \(\('x',\)\)"),
        (dict(attention_variant="kha", kha_targets=()), r"kha_targets \(\(\)\) must be a non-empty"),
        (dict(attention_variant="kha", kha_targets=("q", "q")), r"without repeats"),
        (dict(attention_variant="kha", kha_targets="qkv"), r"kha_targets \('qkv'\) must be a tuple"),
        (dict(attention_variant="mea", mea_num_kv_components=0), r"mea_num_kv_components \(0\)"),
        (dict(attention_variant="mea", mea_num_kv_components=-2), r"mea_num_kv_components \(-2\)"),
        (dict(attention_variant="mea", mea_num_kv_components=8), r"must not exceed num_query_groups \(4\)"),
        (
            dict(attention_variant="mea", num_attention_heads=6, hidden_size=48, num_query_groups=6,
                 mea_num_kv_components=4),
            r"mea_num_kv_components \(4\) must divide num_attention_heads \(6\)",
        ),
        (
            dict(attention_variant="mea", num_attention_heads=12, hidden_size=48,
                 num_query_groups=12, mea_num_kv_components=6, tensor_model_parallel_size=4),
            r"mea_num_kv_components \(6\) must be a multiple or a divisor of "
            r"tensor_model_parallel_size \(4\)",
        ),
        (
            dict(attention_variant="mea", mea_num_kv_components=2, mea_mix_init="identity"),
            r"mea_mix_init='identity' needs mea_num_kv_components \(2\) == num_query_groups \(4\)",
        ),
        (dict(attention_variant="mea", mea_mix_init="eye"), r"mea_mix_init \('eye'\)"),
        (
            dict(attention_variant="mea", mea_num_kv_components_per_layer=(2,)),
            r"mea_num_kv_components_per_layer has 1 entries, num_layers is 2",
        ),
        (
            dict(attention_variant="mea", mea_num_kv_components_per_layer=(2, 3)),
            r"mea_num_kv_components_per_layer \(3\) must divide num_attention_heads \(8\)",
        ),
        (dict(attention_variant="mea", mea_tp_exchange="nccl"), r"mea_tp_exchange \('nccl'\)"),
        (
            dict(attention_variant="mea", mea_key_norm_before_mix=True, qk_layernorm=True,
                 mea_tp_exchange="weights"),
            r"mea_key_norm_before_mix=True cannot be combined with mea_tp_exchange='weights'",
        ),
        (
            dict(attention_variant="mea", mea_key_norm_before_mix=True),
            r"mea_key_norm_before_mix=True needs a k norm \(qk_layernorm=True\)",
        ),
        (
            dict(attention_variant="kha", num_query_groups=2, tensor_model_parallel_size=4),
            r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)",
        ),
        (
            dict(attention_variant="mea", fp8_multi_head_attention=True),
            r"fp8_multi_head_attention=True is not supported",
        ),
        (
            dict(attention_variant="kha", attention_output_gate=True),
            r"attention_output_gate=True is not supported",
        ),
        (
            dict(attention_variant="mea", experimental_attention_variant="dsa"),
            r"experimental_attention_variant \('dsa'\) cannot be combined",
        ),
    ],
)
def test_invalid_configuration_raises_value_error_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        make(**fields)


@pytest.mark.parametrize("variant", ["mea", "kha"])
@pytest.mark.parametrize(
    "feature,extra",
    [
        ("fused_single_qkv_rope", dict(apply_rope_fusion=True)),
        # multi_latent_attention: KHA-Linear is accepted, the rest is refused with its own
        # reasons (tests/layers/test_kha_mla.py).
        ("flash_decode", {}),
    ],
)
def test_features_that_bypass_the_split_are_refused_before_megatron_checks(variant, feature, extra):
    with pytest.raises(ValueError, match=f"{feature}=True is not supported with attention_variant"):
        make(attention_variant=variant, **{feature: True}, **extra)


@pytest.mark.parametrize("exchange", ["activations", "weights", "auto"])
def test_every_tp_exchange_is_accepted(exchange):
    assert make(attention_variant="mea", mea_tp_exchange=exchange).mea_tp_exchange == exchange


@pytest.mark.parametrize(
    "feature", [dict(delay_wgrad_compute=True), dict(cuda_graph_impl="local")],
    ids=["delay_wgrad_compute", "cuda_graph_impl"],
)
def test_weights_exchange_refuses_features_that_keep_a_stale_weight(feature):
    name = next(iter(feature))
    with pytest.raises(ValueError, match=f"mea_tp_exchange='weights' cannot be combined with {name}"):
        make(attention_variant="mea", mea_tp_exchange="weights", **feature)


def test_kha_fold_linear_needs_the_linear_variant():
    with pytest.raises(ValueError, match="kha_fold_linear=True needs kha_variant='linear'"):
        make(attention_variant="kha", kha_variant="mlp", kha_fold_linear=True)
    with pytest.raises(ValueError, match="kha_fold_linear=True cannot be combined with cuda_graph"):
        make(attention_variant="kha", kha_variant="linear", kha_fold_linear=True,
             cuda_graph_impl="local")


def test_unknown_tp_exchange_names_the_field():
    with pytest.raises(ValueError, match="mea_tp_exchange"):
        make(attention_variant="mea", mea_tp_exchange="gather")


def test_per_layer_components_checkpoint_per_layer():
    config = make(attention_variant="mea", mea_num_kv_components_per_layer=[2, 4])
    assert config.kv_components(1) == 2 and config.kv_components(2) == 4
    assert config.mea_mix_init == "repeat"  # the identity where nc == ng
    assert config.hetereogenous_dist_checkpoint  # layers of different shapes: per-layer keys
    with pytest.raises(ValueError, match="no entry for layer 3"):
        config.kv_components(3)


def test_defaults_resolve_by_shape_and_model():
    assert make(attention_variant="mea").mea_num_kv_components == 4
    assert make(attention_variant="mea").mea_mix_init == "identity"
    assert make(attention_variant="mea", mea_num_kv_components=2).mea_mix_init == "repeat"
    dense = make(attention_variant="kha")
    assert (dense.kha_variant, dense.kha_targets) == ("linear", ("q", "k", "v"))
    moe = make(attention_variant="kha", num_moe_experts=4, moe_ffn_hidden_size=32)
    assert (moe.kha_variant, moe.kha_targets) == ("mlp", ("v",))
    assert make(attention_variant="kha", kha_targets=("v", "q")).kha_targets == ("q", "v")


def test_standard_variant_warns_about_ignored_fields(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_mea.config"):
        make(attention_variant="standard", mea_num_kv_components=2)
    assert "ignores mea_num_kv_components" in caplog.text
