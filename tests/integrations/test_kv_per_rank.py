"""`megatron_mea.integrations.kv_per_rank`: the KV-cache bytes a serving rank holds per token
(baseline against MEA virtual heads, under TP and data-parallel attention) and the one-line
warning of the vLLM plugin when a TP size loses MEA's saving."""

import pytest

from megatron_mea.integrations.transformers.configuration_megatron_mea import (
    MegatronMEALlamaConfig,
    MegatronMEAQwen3MoeConfig,
)
from megatron_mea.integrations.kv_per_rank import (
    kv_bytes_per_token_per_rank,
    tp_loses_kv_saving_message,
)
from megatron_mea.model.size import ModelShape, model_size

# Qwen3-30B-A3B (its config.json): 48 layers, 32 query heads, 4 K/V heads of 128, RMS q/k norm.
QWEN3_30B_A3B = dict(num_layers=48, hidden_size=2048, num_attention_heads=32,
                     num_query_groups=4, kv_channels=128, vocab_size=151936, qk_layernorm=True,
                     num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768)
ATTENTION = dict(num_layers=48, num_query_groups=4, head_dim=128)


def test_one_rank_caches_what_model_size_counts_for_the_whole_model():
    # Two derivations of the TP=1 (and data-parallel attention) cache: model_size lays it out
    # as the Megatron decoder does (components plus one inverse RMS per composite key).
    base = model_size(ModelShape(**QWEN3_30B_A3B))["kv_cache_bytes_per_token"]
    mea = model_size(ModelShape(**QWEN3_30B_A3B, attention_variant="mea",
                                mea_num_kv_components=2))["kv_cache_bytes_per_token"]
    assert kv_bytes_per_token_per_rank(**ATTENTION) == base
    assert kv_bytes_per_token_per_rank(**ATTENTION, num_kv_components=2, key_scales=True) == mea


@pytest.mark.parametrize("scales", [False, True], ids=["no-scales", "key-scales"])
def test_the_per_rank_saving_shrinks_with_tp_and_is_gone_at_ng_over_nc(scales):
    def ratio(tp):
        mea = kv_bytes_per_token_per_rank(**ATTENTION, tensor_parallel_size=tp,
                                          num_kv_components=2, key_scales=scales)
        return mea / kv_bytes_per_token_per_rank(**ATTENTION, tensor_parallel_size=tp)

    # A rank's scales (one per composite key of its groups) against the baseline's
    # 2 * (its groups) * hn elements: 1 / (2 * hn) at every TP size.
    scale_share = 1 / (2 * 128) if scales else 0
    assert ratio(1) == pytest.approx(0.5 + scale_share)
    # TP = ng/nc: the baseline's 2 heads per rank against all nc = 2 components.
    assert ratio(2) == pytest.approx(1.0 + scale_share)
    assert ratio(4) > ratio(2) and ratio(8) == ratio(4)  # past ng the baseline replicates


def test_baseline_heads_are_split_then_replicated_past_ng():
    per_rank = [kv_bytes_per_token_per_rank(**ATTENTION, tensor_parallel_size=tp)
                for tp in (1, 2, 4, 8)]
    assert per_rank[0] == 2 * per_rank[1] == 4 * per_rank[2]
    assert per_rank[3] == per_rank[2]


def _qwen3_30b_a3b(nc):
    return MegatronMEAQwen3MoeConfig(num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                     attention_variant="mea", mea_num_kv_components=nc)


@pytest.mark.parametrize("tp, warns", [(1, False), (2, True), (4, True), (8, True)])
def test_the_plugin_warns_when_tp_reaches_ng_over_nc(tp, warns):
    message = tp_loses_kv_saving_message(_qwen3_30b_a3b(2), tp)
    assert (message is not None) == warns
    if warns:
        assert "\n" not in message and f"tensor_parallel_size {tp} >=" in message


def test_no_warning_without_virtual_heads_or_for_kha():
    assert tp_loses_kv_saving_message(_qwen3_30b_a3b(4), 8) is None  # nc == ng
    kha = MegatronMEALlamaConfig(num_key_value_heads=4, attention_variant="kha")
    assert tp_loses_kv_saving_message(kha, 8) is None
    # nc = 1 of 4: TP 2 still saves (1 component against 2 heads), TP 4 does not.
    assert tp_loses_kv_saving_message(_qwen3_30b_a3b(1), 2) is None
    assert tp_loses_kv_saving_message(_qwen3_30b_a3b(1), 4) is not None
