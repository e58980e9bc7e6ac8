"""The spec functions: standard = Megatron's own specs; variants swap only the attention class."""

import dataclasses
import functools

import pytest
from megatron.core.models.gpt import gpt_layer_specs as mcore
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_mea import get_gpt_decoder_block_spec, get_gpt_layer_spec
from megatron_mea._optional import HAVE_TE
from megatron_mea.layers import (
    HeadMix,
    HeadNormedRowParallelLinear,
    HeadRMSNorm,
    KHASelfAttention,
    KnockingHeads,
    MEASelfAttention,
    head_normed_projection,
)
from megatron_mea.specs import PerLayerSelfAttention
from tests._models import tiny_config


def _comparable(spec):
    """`spec` with every `functools.partial` (Megatron-Core 0.17+ builds MLP specs as partials of
    `MLP.as_mlp_submodule`, which compare by identity) replaced by its function and arguments."""
    if isinstance(spec, functools.partial):
        return ("partial", spec.func, _comparable(spec.args), _comparable(spec.keywords))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {f.name: _comparable(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return (type(spec), fields)
    if isinstance(spec, (list, tuple)):
        return type(spec)(_comparable(item) for item in spec)
    if isinstance(spec, dict):
        return {key: _comparable(value) for key, value in spec.items()}
    return spec


def test_comparable_tells_different_partials_apart():
    assert _comparable(functools.partial(max, 1)) == _comparable(functools.partial(max, 1))
    assert _comparable(functools.partial(max, 1)) != _comparable(functools.partial(max, 2))
    assert _comparable(functools.partial(max, a=1)) != _comparable(functools.partial(min, a=1))


def test_standard_block_spec_is_megatrons(single_rank):
    config = tiny_config()
    ours = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    theirs = mcore.get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    assert _comparable(ours) == _comparable(theirs)


def test_standard_layer_spec_is_megatrons():
    config = tiny_config()
    ours = get_gpt_layer_spec(config, use_transformer_engine=False)
    theirs = mcore.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=True, normalization="RMSNorm",
    )
    assert _comparable(ours) == _comparable(theirs)


# The variant's own pieces, as Submodules fields of its attention spec.
_PIECES = {
    "mea": dict(head_mix=HeadMix, head_norm=HeadRMSNorm),
    "kha": dict(knock=KnockingHeads),
}


@pytest.mark.parametrize("variant,cls", [("mea", MEASelfAttention), ("kha", KHASelfAttention)])
def test_variant_block_spec_swaps_only_the_attention_of_every_layer(single_rank, variant, cls):
    config = tiny_config(variant)
    ours = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    theirs = mcore.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    assert len(ours.layer_specs) == 2
    for mine, stock in zip(ours.layer_specs, theirs.layer_specs):
        assert mine.submodules.self_attention.module is cls
        assert stock.submodules.self_attention.module is SelfAttention
        # Megatron's submodules kept (MEA's linear_proj runs the head norm first), the
        # variant's pieces added as fields.
        megatron = dict(vars(stock.submodules.self_attention.submodules))
        if variant == "mea":
            megatron["linear_proj"] = HeadNormedRowParallelLinear
        fields = vars(mine.submodules.self_attention.submodules)
        assert fields == {**megatron, **_PIECES[variant]}
        assert _comparable(mine.submodules.mlp) == _comparable(stock.submodules.mlp)
    # The dense and the MoE layer keep their distinct MLPs.
    dense, moe = (_comparable(layer.submodules.mlp) for layer in ours.layer_specs)
    assert dense != moe


def test_mea_spec_leaves_out_the_pieces_the_config_turns_off(single_rank):
    spec = get_gpt_layer_spec(tiny_config("mea", mea_head_norm=False), use_transformer_engine=False)
    submodules = spec.submodules.self_attention.submodules
    assert submodules.head_norm is None and submodules.linear_proj is RowParallelLinear
    control = get_gpt_layer_spec(tiny_config("mea", mea_hlc=False), use_transformer_engine=False)
    assert control.submodules.self_attention.submodules.head_mix is None


def test_per_layer_spec_holds_the_spec_of_each_layer_kind(single_rank):
    config = tiny_config("mea", attention_variant_per_layer=("standard", "mea"))
    spec = get_gpt_layer_spec(config, use_transformer_engine=False)
    attention = spec.submodules.self_attention
    assert attention.module is PerLayerSelfAttention
    kinds = attention.submodules.attentions
    assert list(kinds) == [MEASelfAttention, SelfAttention]
    assert kinds[SelfAttention].submodules == get_gpt_layer_spec(
        tiny_config(), use_transformer_engine=False).submodules.self_attention.submodules
    assert kinds[MEASelfAttention].submodules.head_mix is HeadMix
    # Megatron's params (the causal mask) once, on the outer spec.
    assert attention.params and not any(kind.params for kind in kinds.values())


def test_head_norm_on_an_unknown_projection_names_the_class():
    class OtherRowParallelLinear(RowParallelLinear):
        pass

    with pytest.raises(ValueError, match="not for OtherRowParallelLinear.*HEAD_NORMED_PROJECTIONS"):
        head_normed_projection(OtherRowParallelLinear)
    assert head_normed_projection(HeadNormedRowParallelLinear) is HeadNormedRowParallelLinear


def test_a_spec_built_for_another_config_is_refused(single_rank):
    from megatron.core.models.gpt import GPTModel

    spec = get_gpt_decoder_block_spec(tiny_config("mea", mea_head_norm=False),
                                      use_transformer_engine=False)
    with pytest.raises(ValueError, match="mea_head_norm=True but the spec's head_norm is None"):
        GPTModel(config=tiny_config("mea"), transformer_layer_spec=spec, vocab_size=96,
                 max_sequence_length=16)
    spec = get_gpt_layer_spec(tiny_config("mea"), use_transformer_engine=False)
    attention = spec.submodules.self_attention
    attention.submodules = dataclasses.replace(attention.submodules, linear_proj=RowParallelLinear)
    with pytest.raises(ValueError, match="must be a head-normed projection"):
        GPTModel(config=tiny_config("mea"), transformer_layer_spec=spec, vocab_size=96,
                 max_sequence_length=16)


def _mlp_class(mlp_spec) -> type:
    """The module class an MLP spec builds: a ModuleSpec (0.16) or a partial (0.17+) of the class
    or of its `as_mlp_submodule` classmethod."""
    if isinstance(mlp_spec, functools.partial):
        builder = mlp_spec.func
        return getattr(builder, "__self__", builder)
    return mlp_spec.module


def test_layer_spec_reads_experts_and_qk_norm_from_the_config():
    config = tiny_config("kha")
    spec = get_gpt_layer_spec(config, use_transformer_engine=False)
    assert spec.submodules.self_attention.module is KHASelfAttention
    assert _mlp_class(spec.submodules.mlp) is MoELayer
    assert spec.submodules.self_attention.submodules.q_layernorm.__name__ != "IdentityOp"
    dense = get_gpt_layer_spec(config, use_transformer_engine=False, num_experts=0,
                               qk_layernorm=False)
    assert _mlp_class(dense.submodules.mlp) is MLP
    assert dense.submodules.self_attention.submodules.q_layernorm.__name__ == "IdentityOp"


@pytest.mark.skipif(HAVE_TE, reason="checks the error raised when Transformer Engine is missing")
def test_transformer_engine_spec_without_te_names_the_extra(single_rank):
    with pytest.raises(ImportError, match=r"megatron_mea\[te\]"):
        get_gpt_layer_spec(tiny_config("mea"), use_transformer_engine=True)
    with pytest.raises(ImportError, match=r"megatron_mea\[te\]"):
        get_gpt_decoder_block_spec(tiny_config("mea"), use_transformer_engine=True)
