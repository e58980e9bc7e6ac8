"""The spec functions: standard = Megatron's own specs; variants swap only the attention class."""

import pytest
from megatron.core.models.gpt import gpt_layer_specs as mcore
from megatron.core.transformer.attention import SelfAttention

from megatron_mea import get_gpt_decoder_block_spec, get_gpt_layer_spec
from megatron_mea._optional import HAVE_TE
from megatron_mea.layers import KHASelfAttention, MEASelfAttention
from tests._models import tiny_config


def test_standard_block_spec_is_megatrons(single_rank):
    config = tiny_config()
    ours = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    theirs = mcore.get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    assert ours == theirs


def test_standard_layer_spec_is_megatrons():
    config = tiny_config()
    ours = get_gpt_layer_spec(config, use_transformer_engine=False)
    theirs = mcore.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=True, normalization="RMSNorm",
    )
    assert ours == theirs


@pytest.mark.parametrize("variant,cls", [("mea", MEASelfAttention), ("kha", KHASelfAttention)])
def test_variant_block_spec_swaps_only_the_attention_of_every_layer(single_rank, variant, cls):
    config = tiny_config(variant)
    ours = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    theirs = mcore.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    assert len(ours.layer_specs) == 2
    for mine, stock in zip(ours.layer_specs, theirs.layer_specs):
        assert mine.submodules.self_attention.module is cls
        assert stock.submodules.self_attention.module is SelfAttention
        assert mine.submodules.self_attention.submodules == stock.submodules.self_attention.submodules
        assert mine.submodules.mlp == stock.submodules.mlp
    # The dense and the MoE layer keep their distinct MLPs.
    assert ours.layer_specs[0].submodules.mlp != ours.layer_specs[1].submodules.mlp


def test_layer_spec_reads_experts_and_qk_norm_from_the_config():
    config = tiny_config("kha")
    spec = get_gpt_layer_spec(config, use_transformer_engine=False)
    assert spec.submodules.self_attention.module is KHASelfAttention
    assert "MoELayer" in spec.submodules.mlp.module.__name__
    dense = get_gpt_layer_spec(config, use_transformer_engine=False, num_experts=None,
                               qk_layernorm=False)
    assert dense.submodules.self_attention.submodules.q_layernorm.__name__ == "IdentityOp"


@pytest.mark.skipif(HAVE_TE, reason="checks the error raised when Transformer Engine is missing")
def test_transformer_engine_spec_without_te_names_the_extra(single_rank):
    with pytest.raises(ImportError, match=r"megatron_mea\[te\]"):
        get_gpt_layer_spec(tiny_config("mea"), use_transformer_engine=True)
    with pytest.raises(ImportError, match=r"megatron_mea\[te\]"):
        get_gpt_decoder_block_spec(tiny_config("mea"), use_transformer_engine=True)
