"""The model description is declared once (`megatron_mea.model.args`) and every consumer derives
it: `mea-pretrain`'s arguments, the run -> config translation, the size arithmetic, the
converters' description and the reading of Megatron-LM's saved arguments. Each test fails if a
consumer grows its own copy of a model field or drops one."""

import ast
import dataclasses
import inspect

import pytest

from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription
from megatron_mea.integrations.args import plugin_fields
from megatron_mea.integrations.mlm_flags import MEGATRON_LM_TAGS, load_flags
from megatron_mea.model.args import (
    ARCHITECTURE_FIELDS,
    MODEL_FIELDS,
    ModelArgs,
    config_fields,
    declared,
)
from megatron_mea.apps.training.arguments import PretrainArgs, build_parser
from megatron_mea.model import gpt
from megatron_mea.model.size import ModelShape

# A non-default value for every architecture field, valid together (a 4-layer MoE model).
NON_DEFAULTS = dict(
    num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    kv_channels=32, seq_length=64, max_position_embeddings=96, normalization="LayerNorm",
    qk_layernorm=False, swiglu=False, untie_embeddings_and_output_weights=False,
    position_embedding_type="learned_absolute", rotary_base=500000.0, use_rope_scaling=True,
    rope_scaling_factor=4.0, layernorm_epsilon=1e-6, add_qkv_bias=True, add_bias_linear=True,
    init_method_std=0.01, hidden_dropout=0.1, attention_dropout=0.1, num_experts=8,
    moe_router_topk=3, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
    moe_layer_freq=[0, 1, 1, 0], moe_router_pre_softmax=True, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
    moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
    moe_token_dispatcher_type="allgather", moe_grouped_gemm=True, vocab_size=1000,
    make_vocab_size_divisible_by=64,
)


def test_every_architecture_field_has_a_test_value_and_a_scope():
    assert set(NON_DEFAULTS) == set(ARCHITECTURE_FIELDS)
    for name in ARCHITECTURE_FIELDS:
        assert declared(name).metadata["scope"] in ("model", "init", "training"), name
        assert NON_DEFAULTS[name] != declared(name).default, name


@pytest.mark.parametrize("consumer", [PretrainArgs, ModelShape])
def test_consumers_inherit_the_declaration_without_redeclaring(consumer):
    assert issubclass(consumer, ModelArgs)
    own = {f.name: f for f in dataclasses.fields(consumer)}
    for f in dataclasses.fields(ModelArgs):
        assert own[f.name].default == f.default and own[f.name].type == f.type, f.name
    # No class between the consumer and ModelArgs annotates a model field again.
    for cls in consumer.__mro__[: consumer.__mro__.index(ModelArgs)]:
        assert not set(cls.__dict__.get("__annotations__", {})) & set(MODEL_FIELDS), cls


def test_pretrain_flags_cover_every_model_field():
    dests = {a.dest for a in build_parser()._actions}
    assert set(MODEL_FIELDS) <= dests


def test_the_config_translation_carries_every_field_it_declares():
    args = PretrainArgs(**NON_DEFAULTS)
    fields = config_fields(args)
    for name in ARCHITECTURE_FIELDS:
        target = declared(name).metadata["config"]
        if target and target != "derived":
            assert fields[target] == NON_DEFAULTS[name], name
    assert fields["ffn_hidden_size"] == 96 and fields["moe_ffn_hidden_size"] == 48
    assert fields["gated_linear_unit"] is False


def test_the_trainer_maps_no_model_field_by_hand():
    # transformer_config / build_model read the model fields only through config_fields and
    # gpt_model_kwargs: a hand-written `args.<model field>` there is a second declaration.
    for function in (gpt.transformer_config, gpt.build_model):
        tree = ast.parse(inspect.getsource(function))
        read = {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "args"}
        assert not read & set(ARCHITECTURE_FIELDS), (function.__name__, read & set(MODEL_FIELDS))


def test_the_resume_check_compares_the_declared_tensor_fields():
    from megatron_mea.checkpoint.torch_dist import saved_settings
    from megatron_mea.model.args import TENSOR_FIELDS

    assert saved_settings.MODEL_SETTINGS is TENSOR_FIELDS
    assert {"num_layers", "moe_router_enable_expert_bias"} <= set(TENSOR_FIELDS)


def test_the_converters_description_is_the_declaration(tmp_path):
    # What a description records; its other fields derive from these at construction.
    recorded = [f.name for f in dataclasses.fields(ModelDescription) if f.init]
    assert recorded == ["args", "hf_config", "source"]
    args = PretrainArgs(**{**NON_DEFAULTS, "moe_grouped_gemm": False}, mock_data=True)
    ModelDescription(args).save(str(tmp_path))
    loaded = ModelDescription.load(str(tmp_path)).args
    for name in MODEL_FIELDS:
        assert getattr(loaded, name) == getattr(args, name), name


def test_size_arithmetic_reads_megatron_lm_namespaces_by_the_declared_names():
    import argparse

    namespace = argparse.Namespace(**NON_DEFAULTS,
                                   group_query_attention=True, padded_vocab_size=1024)
    shape = ModelShape.from_args(namespace)
    for name in ARCHITECTURE_FIELDS:
        if name != "vocab_size":
            assert getattr(shape, name) == NON_DEFAULTS[name], name
    assert shape.vocab_size == 1024


@pytest.mark.parametrize("tag", sorted(MEGATRON_LM_TAGS))
def test_every_model_field_is_a_megatron_lm_argument(tag):
    """Each model field is read from a Megatron-LM checkpoint's saved arguments under its
    declared name: the name must be a flag of Megatron-LM (or of the plugin) at both tags."""
    dests = {flag["dest"] for flag in load_flags(tag)["flags"]}
    dests |= {f.name for f in plugin_fields()}
    missing = [n for n in MODEL_FIELDS if n not in dests]
    assert not missing


def test_sizes_left_unset_are_filled_in_one_way_by_every_consumer():
    from megatron_mea.checkpoint.megatron_lm.writing import megatron_lm_arguments
    from megatron_mea.model.args import RunArgs, derived_sizes, gpt_model_kwargs

    unset = dict(NON_DEFAULTS, ffn_hidden_size=None, kv_channels=None, num_query_groups=None,
                 moe_ffn_hidden_size=None, max_position_embeddings=None)
    run = RunArgs(**{**unset, "moe_grouped_gemm": False})
    sizes = derived_sizes(run)
    assert sizes == dict(num_query_groups=4, kv_channels=16, ffn_hidden_size=256,
                         moe_ffn_hidden_size=256, max_position_embeddings=64)
    saved = megatron_lm_arguments(run, optimizer_saved=False)
    shape = ModelShape(**unset)
    config = gpt.transformer_config(run)
    for name, value in sizes.items():
        assert getattr(saved, name) == value, name
        if name != "max_position_embeddings":  # neither says positions
            assert getattr(shape, name) == value, name
            assert getattr(config, name) == value, name
    assert gpt_model_kwargs(run)["max_sequence_length"] == sizes["max_position_embeddings"]
