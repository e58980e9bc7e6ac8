"""Hugging Face configs of MEA / KHA models: the base family's config plus the variant fields.

Self-contained (imports only transformers), so that it can be copied next to an exported
checkpoint and loaded with `trust_remote_code=True`.

Variant fields (same names and meaning as `megatron_mea.MEATransformerConfig`):
    attention_variant: "mea" or "kha".
    mea_num_kv_components: nc, the component K/V heads `k_proj` / `v_proj` produce (default
        num_key_value_heads).
    mea_head_norm: RMS-normalise each query head's attention output before `o_proj`.
    kha_variant: "linear" or "mlp"; kha_targets: transformed heads, e.g. ["q", "k", "v"].
"""

from transformers import (
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VARIANT_DEFAULTS = dict(
    attention_variant="mea",
    mea_num_kv_components=None,
    mea_head_norm=True,
    kha_variant=None,
    kha_targets=None,
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
