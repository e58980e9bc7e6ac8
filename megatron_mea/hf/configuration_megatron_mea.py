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
