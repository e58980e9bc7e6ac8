"""The attention-variant fields are declared once (`megatron_mea.variant`) and every consumer
derives them: the Megatron config, `mea-pretrain`'s flags and YAML, the run -> config translation,
the model-size arithmetic. Each test fails if a consumer grows its own copy or drops a field."""

import dataclasses

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mea import MEATransformerConfig
from megatron_mea.apps.training.arguments import PretrainArgs, build_parser, parse_args
from megatron_mea.model.gpt import transformer_config
from megatron_mea.model.size import ModelShape, model_size
from megatron_mea.variant import (
    VARIANT_FIELDS,
    AttentionVariantFields,
    choices,
    default_kha_variant,
    fields_of_scope,
)

# A non-default value for every variant field, valid together on a 4-layer MEA model
# (8 heads, 4 groups) except where a test swaps the variant.
NON_DEFAULTS = dict(
    attention_variant="mea",
    attention_variant_per_layer=("standard", "mea", "mea", "standard"),
    mea_num_kv_components=2,
    mea_num_kv_components_per_layer=(4, 2, 4, 4),
    mea_hlc=True,
    mea_head_norm=False,
    mea_key_norm_before_mix=True,
    mea_mix_init="normal",
    mea_tp_exchange="auto",
    kha_variant="linear",
    kha_targets=("q", "v"),
    kha_fold_linear=True,
    kha_init="random",
)


def test_every_variant_field_has_a_scope_and_a_test_value():
    assert set(NON_DEFAULTS) == set(VARIANT_FIELDS)
    assert sorted(fields_of_scope("model", "init", "training")) == sorted(VARIANT_FIELDS)


def test_the_config_adds_exactly_the_variant_fields_to_megatron():
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    added = {f.name for f in dataclasses.fields(MEATransformerConfig)} - base
    assert added == set(VARIANT_FIELDS)


@pytest.mark.parametrize("consumer", [PretrainArgs, ModelShape])
def test_consumers_inherit_the_declaration(consumer):
    assert issubclass(consumer, AttentionVariantFields)
    own = {f.name: f for f in dataclasses.fields(consumer)}
    for f in dataclasses.fields(AttentionVariantFields):
        assert own[f.name].default == f.default and own[f.name].type == f.type, f.name


def test_pretrain_flags_carry_the_declared_choices_and_help():
    by_dest = {a.dest: a for a in build_parser()._actions}
    for name in VARIANT_FIELDS:
        action = by_dest[name]
        assert action.help, f"--{name} has no help"
        if choices(name):
            assert tuple(action.choices) == choices(name), name


def test_every_variant_field_reaches_the_megatron_config():
    args = PretrainArgs(
        num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, num_experts=None,
        mock_data=True, **NON_DEFAULTS,
    )
    config = transformer_config(args)
    for name, value in NON_DEFAULTS.items():
        assert getattr(config, name) == value, name


def test_pretrain_flags_parse_every_variant_field():
    argv = ["--mock-data", "--num-layers", "4", "--num-attention-heads", "8",
            "--num-query-groups", "4", "--num-experts", "0"]
    for name, value in NON_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    args = parse_args(argv)
    for name, value in NON_DEFAULTS.items():
        got = getattr(args, name)
        assert (tuple(got) if isinstance(got, list) else got) == value, name


@pytest.mark.parametrize("experts", [None, 4])
def test_size_accounting_and_config_resolve_the_same_defaults(experts):
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=128) if experts else {}
    config = MEATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                                  num_query_groups=4, attention_variant="kha", **moe)
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                       vocab_size=128, num_experts=experts, attention_variant="kha")
    assert (shape.kha_variant, shape.kha_targets) == (config.kha_variant, config.kha_targets)
    assert config.kha_variant == default_kha_variant(bool(experts))


def test_size_accounting_follows_per_layer_variants():
    common = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  vocab_size=128)
    standard = model_size(ModelShape(**common))
    mea = model_size(ModelShape(**common, attention_variant="mea", mea_num_kv_components=2))
    mixed = model_size(ModelShape(
        **common, attention_variant="mea", mea_num_kv_components=2,
        attention_variant_per_layer=("standard", "mea", "mea", "standard")))
    # Half of the layers are MEA: the cache and the extra parameters are the averages.
    for key in ("kv_cache_bytes_per_token", "total_params"):
        assert mixed[key] * 2 == standard[key] + mea[key], key
