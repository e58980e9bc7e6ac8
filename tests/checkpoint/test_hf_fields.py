"""The Hugging Face <-> description field table (`checkpoint/hf/fields.py`): it names every field
of every supported family's transformers config class, every model field it does not carry is
named with why, and every carried field comes back from an export's config through an import,
field by field (issue 37: moe_aux_loss_coeff came back ten times smaller when
router_aux_loss_coef was not written). Config dicts only: no tensors, no training."""

import dataclasses
import inspect

import pytest

from megatron_mea.checkpoint.hf.config import description_from_hf, hf_config_dict, stock_limits
from megatron_mea.checkpoint.hf.families import FAMILIES
from megatron_mea.checkpoint.hf.fields import (
    CARRIED,
    FIXED,
    NOT_CARRIED,
    NOT_MODEL,
    of_family,
    settings_left_out,
)
from megatron_mea.checkpoint.torch_dist.model_only import ConversionError, ModelDescription
from megatron_mea.model.args import ModelArgs, RunArgs
from megatron_mea.variant import AttentionVariantFields


def _config_class(name):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[name]


def _class_fields(name):
    parameters = inspect.signature(_config_class(name).__init__).parameters
    return {p for p, spec in parameters.items()
            if p != "self" and spec.kind not in (spec.VAR_KEYWORD, spec.VAR_POSITIONAL)}


def _carried_run_fields(fam):
    return [name for carried in of_family(CARRIED, fam) for name in carried.run]


@pytest.mark.parametrize("fam", FAMILIES)
def test_every_field_of_the_family_config_is_carried_fixed_or_named(fam):
    carried = {name for entry in of_family(CARRIED, fam) for name in entry.hf}
    fixed = {entry.hf for entry in of_family(FIXED, fam)}
    assert not carried & fixed
    assert sorted(_class_fields(fam) - carried - fixed - set(NOT_MODEL)) == []


def test_every_model_field_is_carried_or_named_with_why():
    carried = {name for entry in CARRIED for name in entry.run}
    variant = {f.name for f in dataclasses.fields(AttentionVariantFields)}
    model = {f.name for f in dataclasses.fields(ModelArgs)} - variant
    assert not carried & set(NOT_CARRIED)
    assert sorted(model - carried - set(NOT_CARRIED)) == []


# A model per family with a value no default has in every carried field.
_COMMON = dict(
    num_layers=4, hidden_size=96, ffn_hidden_size=200, num_attention_heads=6,
    num_query_groups=2, kv_channels=24, max_position_embeddings=16384, seq_length=4096,
    layernorm_epsilon=1e-6, untie_embeddings_and_output_weights=False, rotary_base=500000,
    use_rope_scaling=True, rope_scaling_factor=16.0, init_method_std=0.0125,
    attention_dropout=0.05, bf16=True, vocab_size=1000, qk_layernorm=False, num_experts=None,
)
_MOE = dict(num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=80, moe_aux_loss_coeff=0.03)
MODELS = {
    "llama": {},
    "qwen2": dict(add_qkv_bias=True),
    "qwen3": dict(qk_layernorm=True),
    "qwen3_moe": dict(_MOE, qk_layernorm=True, moe_layer_freq=[0, 1, 1, 1],
                      moe_router_pre_softmax=True),
    # Mixtral has no dense layer: its dense width is its expert width.
    "mixtral": dict(_MOE, ffn_hidden_size=80),
}


def _exported(fam):
    description = ModelDescription(RunArgs(**dict(_COMMON, **MODELS[fam])))
    family, fields = hf_config_dict(description, stock_limits(description))
    assert family.name == fam
    return description, fields


@pytest.mark.parametrize("fam", FAMILIES)
def test_every_carried_field_survives_export_then_import(fam):
    description, fields = _exported(fam)
    back = description_from_hf(_config_class(fam)(**fields))
    default = ModelDescription(RunArgs()).resolved
    for name in _carried_run_fields(fam):
        original = getattr(description.resolved, name)
        assert original != getattr(default, name), f"{name}: the test's value is a default"
        assert getattr(back.resolved, name) == original, name


_OTHER_VALUES = dict(hidden_act="gelu", mlp_bias=True, attention_bias=True,
                     use_sliding_window=True, sliding_window=128,
                     layer_types=["sliding_attention"] * 4, router_jitter_noise=0.1)


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_fixed_field_of_another_value_is_refused_by_name(fam):
    _, fields = _exported(fam)
    for fixed in of_family(FIXED, fam):
        config = _config_class(fam)(**fields)
        setattr(config, fixed.hf, _OTHER_VALUES[fixed.hf])
        with pytest.raises(ConversionError, match=rf"^{fixed.hf} \("):
            description_from_hf(config)


def test_a_pattern_of_every_nth_layer_comes_back_as_moe_layer_freq_n():
    model = dict(_COMMON, **MODELS["qwen3_moe"])
    description = ModelDescription(RunArgs(**dict(model, moe_layer_freq=2)))
    _, fields = hf_config_dict(description, stock_limits(description))
    assert fields["mlp_only_layers"] == [1, 3]
    back = description_from_hf(_config_class("qwen3_moe")(**fields))
    assert back.args.moe_layer_freq == 2


def test_training_settings_no_config_has_are_named():
    args = RunArgs(hidden_dropout=0.1, moe_router_load_balancing_type="seq_aux_loss")
    assert settings_left_out(args) == [
        "hidden_dropout=0.1", "moe_router_load_balancing_type='seq_aux_loss'"]
    assert settings_left_out(RunArgs(moe_token_dispatcher_type="allgather")) == []
