"""Property: every MEATransformerConfig either builds a model that runs forward and backward at
TP=1, or raises a ValueError whose message names a config field. No other exception."""

import dataclasses
import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron.core.models.gpt import GPTModel

from megatron_mea import MEATransformerConfig, get_gpt_decoder_block_spec
from tests._models import CPU_EXACT

FIELDS = {f.name for f in dataclasses.fields(MEATransformerConfig)}

configs = st.fixed_dictionaries(
    {
        "attention_variant": st.sampled_from(["standard", "mea", "kha", "mla", ""]),
        "num_attention_heads": st.integers(1, 8),
        "num_query_groups": st.one_of(st.none(), st.integers(0, 8)),
        "kv_channels": st.sampled_from([2, 4, 6, 8]),
        "tensor_model_parallel_size": st.sampled_from([1, 1, 1, 2, 4]),
        "qk_layernorm": st.booleans(),
        "mea_num_kv_components": st.one_of(st.none(), st.integers(-1, 9)),
        "mea_mix_init": st.sampled_from([None, "identity", "repeat", "normal", "eye"]),
        "mea_head_norm": st.booleans(),
        "mea_tp_exchange": st.sampled_from(["activations", "weights", "auto", "gather"]),
        "kha_fold_linear": st.booleans(),
        "kha_variant": st.sampled_from([None, "linear", "mlp", "conv"]),
        "kha_targets": st.one_of(
            st.none(),
            st.lists(st.sampled_from(["q", "k", "v", "x"]), max_size=4).map(tuple),
            st.just("qkv"),
        ),
        "num_moe_experts": st.sampled_from([None, 2]),
    }
)


def _build_and_run(config):
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=32,
        max_sequence_length=8,
        position_embedding_type="rope",
    )
    tokens = torch.randint(0, 32, (2, 8))
    position_ids = torch.arange(8).expand_as(tokens)
    loss = model(tokens, position_ids, attention_mask=None, labels=tokens).mean()
    loss.backward()
    assert torch.isfinite(loss)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=configs)
def test_every_config_builds_and_runs_or_names_a_field(single_rank, fields):
    extra = dict(num_layers=1, hidden_size=16, add_bias_linear=False, normalization="RMSNorm",
                 **CPU_EXACT)
    if fields["num_moe_experts"]:
        extra.update(moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_router_load_balancing_type="none")
    try:
        config = MEATransformerConfig(**fields, **extra)
    except ValueError as exc:
        # Megatron's own messages sometimes name the flag (--moe-router-topk) for the field.
        message = re.sub(r"--([a-z0-9-]+)", lambda m: m.group(1).replace("-", "_"), str(exc))
        named = [name for name in FIELDS if name in message]
        assert named, f"ValueError names no config field: {exc}"
        return
    if config.tensor_model_parallel_size == 1:
        _build_and_run(config)
