"""Hugging Face configs of MEA / KHA models: the base family's config plus the variant fields.

Self-contained (imports only transformers), so that it can be copied next to an exported
checkpoint and loaded with `trust_remote_code=True`.

Variant fields: the model-scope fields of `megatron_mea.variant.AttentionVariantFields` (same
names and meaning; `mea-convert export-hf` writes all of them, resolved), e.g.
`attention_variant`, `mea_num_kv_components`, `mea_hlc`, `mea_head_norm`, `kha_variant`,
`kha_targets`. There are no defaults here: a config without them is refused by the modeling code.

Router fields (Qwen3-MoE only, optional): `moe_router_score_function` (`softmax` / `sigmoid`),
`moe_router_pre_softmax`, `moe_router_enable_expert_bias`, `moe_router_topk_scaling_factor`,
`moe_shared_expert_intermediate_size`, Megatron-Core's names and meaning. When
`moe_router_score_function` is set, the model routes as Megatron does (the modeling file's
`MegatronRouter`) instead of the stock router; `mea-convert export-hf` writes all of them then.

`qk_layernorm` (Qwen3-MoE only, optional): false leaves out `q_norm` / `k_norm`, for MoE models
without QK norm that Mixtral cannot express (dense and MoE layers mixed, Megatron's router).
"""

from transformers import (
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)


# Megatron's router settings a native Qwen3-MoE config.json carries (Megatron-Core's names; the
# modeling code's `MegatronRouter` computes them), with the value under which a stock family
# routes the same way (None: any value a stock family can say).
ROUTER_FIELDS = {
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_pre_softmax": None,
}


def router_outside_stock(config):
    """(field, value) of the first router setting of `config` (a native config, or Megatron's
    `TransformerConfig`: the same names) that no stock family's MoE block computes, or None."""
    for name, stock in ROUTER_FIELDS.items():
        value = getattr(config, name, None)
        if name != "moe_router_pre_softmax" and value and value != stock:
            return name, value
    return None


class MegatronMEALlamaConfig(LlamaConfig):
    """Llama with an MEA / KHA attention variant."""

    model_type = "megatron_mea_llama"


class MegatronMEAQwen2Config(Qwen2Config):
    """Qwen2 with an MEA / KHA attention variant."""

    model_type = "megatron_mea_qwen2"


class MegatronMEAQwen3Config(Qwen3Config):
    """Qwen3 with an MEA / KHA attention variant."""

    model_type = "megatron_mea_qwen3"


class MegatronMEAQwen3MoeConfig(Qwen3MoeConfig):
    """Qwen3-MoE with an MEA / KHA attention variant."""

    model_type = "megatron_mea_qwen3_moe"


class MegatronMEAMixtralConfig(MixtralConfig):
    """Mixtral with an MEA / KHA attention variant."""

    model_type = "megatron_mea_mixtral"


CONFIGS = {
    cls.model_type: cls
    for cls in (
        MegatronMEALlamaConfig,
        MegatronMEAQwen2Config,
        MegatronMEAQwen3Config,
        MegatronMEAQwen3MoeConfig,
        MegatronMEAMixtralConfig,
    )
}
