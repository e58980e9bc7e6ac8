"""What the vLLM plugin's layers would compute differently is refused, naming the field."""

import pytest

from megatron_mea.integrations.transformers.configuration_megatron_mea import MegatronMEAQwen3MoeConfig
from megatron_mea.integrations.vllm.models import _refuse_what_vllm_layers_cannot_compute

VARIANT = dict(attention_variant="mea", mea_head_norm=False, mea_hlc=True)


def _config(**router):
    return MegatronMEAQwen3MoeConfig(num_experts=4, num_experts_per_tok=2, **VARIANT, **router)


@pytest.mark.parametrize("router, match", [
    (dict(moe_router_score_function="sigmoid"), r"moe_router_score_function \('sigmoid'\)"),
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=True),
     r"moe_router_enable_expert_bias \(True\)"),
    (dict(moe_router_score_function="softmax", moe_router_topk_scaling_factor=2.5),
     r"moe_router_topk_scaling_factor \(2.5\)"),
    (dict(moe_router_score_function="softmax", moe_shared_expert_intermediate_size=48),
     r"moe_shared_expert_intermediate_size \(48\)"),
    (dict(qk_layernorm=False), r"qk_layernorm \(False\)"),
])
def test_megatron_only_routing_and_missing_qk_norm_are_refused(router, match):
    with pytest.raises(ValueError, match=match):
        _refuse_what_vllm_layers_cannot_compute(_config(**router))


def test_softmax_routing_as_the_stock_block_computes_it_is_served():
    # Softmax after or before top-k is Qwen3-MoE's norm_topk_prob true / false.
    for pre_softmax in (False, True):
        _refuse_what_vllm_layers_cannot_compute(
            _config(moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax))
