"""Hugging Face `config.json` <-> the Megatron model description (`RunArgs`).

Import refuses what the Megatron model cannot compute the same way (another activation, RoPE
scaling other than Megatron's llama3 form, sliding windows, biases Megatron does not have),
naming the config field. Export rebuilds the family's config: from the imported `config.json`
when there is one (checked against the Megatron model), otherwise from the model's sizes.

Vocabulary: the embedding and output rows are padded to a multiple of
`make_vocab_size_divisible_by` (128 by default, as Megatron-LM), recorded with the true
`vocab_size` in `config.yaml`; export strips the padding rows again.
"""

import inspect
import math
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_mea.checkpoint.hf.families import FAMILIES, Family, family
from megatron_mea.checkpoint.torch_dist.model_only import ConversionError, ModelDescription
from megatron_mea.data.tokenizers import ByteLevelTokenizer
from megatron_mea.model_args import RUN_FIELDS, RunArgs, derived_sizes, moe_layers_of_freq
from megatron_mea.variant import fields_of_scope

NATIVE_PREFIX = "megatron_mea_"
_ARG_FIELDS = set(RUN_FIELDS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The variant fields a native `megatron_mea_*` config.json carries (resolved, never None where
# they apply): the model-scope fields of `megatron_mea.variant`, less the per-layer ones (a
# native export has one setting for all layers).
VARIANT_FIELDS = tuple(name for name in fields_of_scope("model") if not name.endswith("_per_layer"))


# Training settings that the HF configs of every family (or of the MoE families) also carry:
# (RunArgs field, HF config field, MoE families only). An export writes them and an import reads
# them back, so continued pretraining after a round trip trains as the run did (transformers'
# own default router_aux_loss_coef is 0.001, Megatron's moe_aux_loss_coeff 0.01).
HF_TRAINING_FIELDS = (
    ("init_method_std", "initializer_range", False),
    ("attention_dropout", "attention_dropout", False),
    ("moe_aux_loss_coeff", "router_aux_loss_coef", True),
)


def byte_level_run(description: ModelDescription) -> bool:
    """Whether the model was trained from scratch on `ByteLevelTokenizer` ids (an import keeps
    the tokenizer files of its HF source instead): its export gets the equal HF tokenizer and
    `<eod>` as the end-of-sequence token."""
    return description.args.tokenizer_type == "ByteLevelTokenizer" and not description.hf_config


def non_stock_router(config) -> Optional[Tuple[str, object]]:
    """(field, value) of the first router setting of `config` (an `MEATransformerConfig`) that
    no stock transformers family computes, or None (`router_outside_stock`)."""
    # Imported here: megatron_mea.hf needs the `hf` extra, this module only when converting.
    from megatron_mea.hf.configuration_megatron_mea import router_outside_stock

    if not config.num_moe_experts:
        return None
    return router_outside_stock(config)


def mixtral_cannot_say(config) -> Optional[str]:
    """Why Mixtral (an MoE block in every layer, softmax over the top-k logits) cannot express
    the MoE model of `config` (an `MEATransformerConfig`): the setting and its value, or None."""
    if not all(moe_layers_of_freq(config.moe_layer_freq, config.num_layers)):
        return f"moe_layer_freq ({config.moe_layer_freq})"
    if config.moe_router_pre_softmax:
        return "moe_router_pre_softmax (True)"
    router = non_stock_router(config)
    return f"{router[0]} ({router[1]!r})" if router else None


def needs_native_qwen3_moe(config) -> Optional[str]:
    """Why an MoE model without QK norm needs the native Qwen3-MoE export (its `qk_layernorm`
    field false): what Mixtral, the stock family without QK norm, cannot say; or None."""
    if not config.num_moe_experts or config.qk_layernorm:
        return None
    return mixtral_cannot_say(config)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


def split_model_type(model_type: str) -> Tuple[Family, bool]:
    """(family, whether the config is one of our native variant configs)."""
    native = model_type.startswith(NATIVE_PREFIX)
    return family(model_type[len(NATIVE_PREFIX):] if native else model_type), native


# Megatron-LM's default padding multiple. Every power-of-two TP size up to 128 divides it, so a
# checkpoint keeps the same rows at any of them (RunArgs pads without the TP factor).
VOCAB_MULTIPLE = 128
# Megatron-Core's llama3 RoPE scaling takes only `factor`; the other parameters are the
# defaults of `RotaryEmbedding._apply_scaling` (read there, so a release that changes them is
# followed): low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192.
_FIXED = inspect.signature(RotaryEmbedding._apply_scaling).parameters
LLAMA3_FIXED = dict(
    low_freq_factor=float(_FIXED["low_freq_factor"].default),
    high_freq_factor=float(_FIXED["high_freq_factor"].default),
    original_max_position_embeddings=_FIXED["original_max_position_embeddings"].default,
)


def rope_settings(config) -> Tuple[float, Optional[float]]:
    """(rope_theta, llama3 scaling factor or None) of an HF config.

    Raises:
        ConversionError: a RoPE type other than default / llama3, or a llama3 parameter that
            Megatron fixes at another value.
    """
    parameters = getattr(config, "rope_parameters", None)
    if not parameters:  # configs written before transformers 5: separate fields
        parameters = dict(getattr(config, "rope_scaling", None) or {},
                          rope_theta=getattr(config, "rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    theta = float(parameters["rope_theta"])
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(
            f"rope_parameters.partial_rotary_factor ({parameters['partial_rotary_factor']!r}) is "
            "not supported: mea-pretrain rotates every channel of a head"
        )
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConversionError(
            f"rope_parameters.rope_type ({rope_type!r}) is not supported: Megatron's RoPE "
            "scales frequencies the llama3 way only"
        )
    for name, fixed in LLAMA3_FIXED.items():
        if parameters.get(name) != fixed:
            raise ConversionError(
                f"rope_parameters.{name} ({parameters.get(name)!r}) is not supported: Megatron's "
                f"llama3 RoPE scaling fixes it at {fixed!r} (only factor is configurable)"
            )
    return theta, float(parameters["factor"])


def rope_parameters(args: RunArgs, theta: float) -> Dict:
    """The HF `rope_parameters` of a model with `args`' RoPE settings (inverse of
    `rope_settings`)."""
    if not args.use_rope_scaling:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": args.rope_scaling_factor,
            **LLAMA3_FIXED}


def vocab_multiple(requested: Optional[int], tp: int) -> int:
    """The padding multiple of the vocabulary at import (see `VOCAB_MULTIPLE`).

    Args:
        requested: the user's multiple, or None for the default: `VOCAB_MULTIPLE` (its least
            common multiple with a TP size that does not divide it).
        tp: the tensor-parallel size recorded in the checkpoint's arguments.

    Raises:
        ConversionError: `requested` is not a multiple of `tp` (the rows would not split).
    """
    if requested is None:
        return math.lcm(VOCAB_MULTIPLE, tp)
    if requested < 1 or requested % tp:
        raise ConversionError(
            f"make_vocab_size_divisible_by ({requested}) must be a positive multiple of "
            f"tensor_model_parallel_size ({tp})"
        )
    return requested


def _refuse(config, name: str, allowed, why: str) -> None:
    value = getattr(config, name, allowed)
    if value != allowed:
        raise ConversionError(f"{name} ({value!r}) is not supported: {why}")


def moe_layer_pattern(fam: Family, config) -> List[bool]:
    """Per layer, whether it is an MoE layer (HF's rule for the family)."""
    if fam.moe is None:
        return [False] * config.num_hidden_layers
    if fam.name == "qwen3_moe":
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]
    return [True] * config.num_hidden_layers


def _num_experts(config) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


def check_supported(fam: Family, config) -> None:
    """Raise ConversionError for HF settings the Megatron model would compute differently."""
    _refuse(config, "hidden_act", "silu", "Megatron's model here is SwiGLU with SiLU")
    _refuse(config, "mlp_bias", False, "Megatron's MLPs here have no biases")
    if fam.name in ("llama", "qwen3", "qwen3_moe"):
        _refuse(config, "attention_bias", False, "only Qwen2's q/k/v biases are supported")
    for name in ("use_sliding_window", "sliding_window"):
        if getattr(config, name, None) and (name == "use_sliding_window" or fam.name == "mixtral"):
            raise ConversionError(
                f"{name} ({getattr(config, name)!r}) is not supported: sliding-window attention "
                "is not wired through mea-pretrain"
            )
    rope_settings(config)
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConversionError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def description_from_hf(
    config,
    *,
    dtype: Optional[torch.dtype] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
    tokenizer_dir: Optional[str] = None,
    parallel: Optional[Dict[str, int]] = None,
    **variant,
) -> ModelDescription:
    """The Megatron model of an HF config (a transformers config object).

    Args:
        config: the HF config (a native `megatron_mea_*` config keeps its variant fields).
        variant: the variant to upcycle to, as `VARIANT_FIELDS` keywords (`attention_variant`,
            `mea_head_norm`, `mea_hlc`, `kha_variant`, `kha_targets`, ...); ignored for native
            configs, which say it themselves. The head norm is off unless asked for: even at
            scale 1 it changes the function.
        dtype: parameter dtype. Default: bfloat16 if the config says so, else float32.
        make_vocab_size_divisible_by: Megatron pads the vocabulary to a multiple of this (zero
            rows; `vocab_size` keeps the HF size). Default: 128 (`vocab_multiple`).
        tokenizer_dir: recorded as the run's HuggingFaceTokenizer model.
        parallel: RunArgs parallel sizes to record (e.g. tensor_model_parallel_size).
    """
    fam, native = split_model_type(config.model_type)
    check_supported(fam, config)
    unknown = sorted(set(variant) - set(VARIANT_FIELDS))
    if unknown:
        raise TypeError(f"description_from_hf: unknown variant settings {unknown}")
    variant = {"attention_variant": "standard", "mea_head_norm": False, **variant}
    if native:
        variant = {name: getattr(config, name, None) for name in VARIANT_FIELDS}
        missing = [name for name, value in variant.items() if value is None
                   and name in ("attention_variant", "mea_head_norm", "mea_hlc")]
        if missing:
            raise ConversionError(
                f"{config.model_type} config.json lacks {', '.join(missing)} (a native export "
                "writes every variant field)"
            )
    if variant.get("kha_targets") is not None:
        variant["kha_targets"] = list(variant["kha_targets"])
    tp = (parallel or {}).get("tensor_model_parallel_size") or 1
    make_vocab_size_divisible_by = vocab_multiple(make_vocab_size_divisible_by, tp)
    if dtype is None:
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = torch.bfloat16 if str(saved).endswith("bfloat16") else torch.float32
    theta, scaling = rope_settings(config)
    moe_layers = moe_layer_pattern(fam, config)
    fields = dict(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=_head_dim(config),
        max_position_embeddings=config.max_position_embeddings,
        seq_length=min(config.max_position_embeddings, 4096),
        normalization="RMSNorm",
        qk_layernorm=getattr(config, "qk_layernorm", fam.qk_layernorm) if native
        else fam.qk_layernorm,
        swiglu=True,
        untie_embeddings_and_output_weights=not getattr(config, "tie_word_embeddings", False),
        position_embedding_type="rope",
        rotary_base=int(theta) if theta.is_integer() else theta,
        use_rope_scaling=scaling is not None,
        rope_scaling_factor=scaling or RunArgs.rope_scaling_factor,
        num_experts=None,
        **variant,
        bf16=dtype == torch.bfloat16,
        vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        layernorm_epsilon=config.rms_norm_eps,
        add_qkv_bias=fam.add_qkv_bias,
        **(parallel or {}),
    )
    fields.update({name: getattr(config, hf_name) for name, hf_name, moe in HF_TRAINING_FIELDS
                   if hasattr(config, hf_name) and (fam.moe is not None or not moe)})
    if tokenizer_dir:
        fields.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    if fam.moe is not None:
        fields.update(
            num_experts=_num_experts(config),
            moe_router_topk=config.num_experts_per_tok,
            moe_ffn_hidden_size=getattr(config, "moe_intermediate_size", config.intermediate_size),
            moe_layer_freq=1 if all(moe_layers) else [int(m) for m in moe_layers],
            # Mixtral and Qwen3-MoE with norm_topk_prob renormalise the top-k probabilities, which
            # is Megatron's top-k-then-softmax; otherwise softmax over all experts, then top-k.
            moe_router_pre_softmax=fam.name == "qwen3_moe" and not config.norm_topk_prob,
        )
        if native and getattr(config, "moe_router_score_function", None) is not None:
            from megatron_mea.hf.configuration_megatron_mea import ROUTER_FIELDS

            fields.update({name: getattr(config, name) for name in ROUTER_FIELDS})
    unknown = sorted(set(fields) - _ARG_FIELDS)
    if unknown:
        raise TypeError(f"description_from_hf: {unknown} are not RunArgs fields")
    hf_config = config.to_dict()
    for name in VARIANT_FIELDS:
        hf_config.pop(name, None)
    if native:
        hf_config["model_type"] = fam.name
        hf_config["architectures"] = [fam.architecture]
    description = ModelDescription(RunArgs(**fields), hf_config)
    description.transformer_config()  # validates the variant and the parallel sizes
    return description


def _family_for(description: ModelDescription, config) -> Family:
    """The family of a model trained from scratch (no HF config to follow); `config`: its
    `transformer_config(meta=True)`."""
    args = description.args
    if config.add_qkv_bias:
        return FAMILIES["qwen2"]
    if args.num_experts:
        native_qwen3_moe = args.qk_layernorm or needs_native_qwen3_moe(config)
        return FAMILIES["qwen3_moe" if native_qwen3_moe else "mixtral"]
    return FAMILIES["qwen3" if args.qk_layernorm else "llama"]


def hf_config_dict(description: ModelDescription, config) -> Tuple[Family, Dict]:
    """The family and the stock HF config fields of the model of `description` (`config`: its
    `transformer_config(meta=True)`).

    Starts from the imported HF config when there is one; every size the Megatron model fixes is
    (re)written from it, and a family that cannot express the model is refused.
    """
    args = description.args
    template = dict(description.hf_config or {})
    fam = family(template["model_type"]) if template else _family_for(description, config)
    for name, value, wanted in (
        ("swiglu", args.swiglu, True),
        ("normalization", config.normalization, "RMSNorm"),
        ("position_embedding_type", args.position_embedding_type, "rope"),
        ("add_bias_linear", config.add_bias_linear, False),
    ):
        if value != wanted:
            raise ConversionError(
                f"{name} ({value!r}) cannot be exported: the {fam.name} family needs {wanted!r}"
            )
    # The native Qwen3-MoE model drops q_norm / k_norm when its config says qk_layernorm false
    # (an MoE model without QK norm that Mixtral cannot express).
    without_qk_norm = fam.name == "qwen3_moe" and needs_native_qwen3_moe(config) is not None
    if fam.qk_layernorm != bool(config.qk_layernorm) and not without_qk_norm:
        raise ConversionError(
            f"qk_layernorm ({config.qk_layernorm}) does not match the {fam.name} family"
        )
    if fam.add_qkv_bias != bool(config.add_qkv_bias):
        raise ConversionError(
            f"add_qkv_bias ({config.add_qkv_bias}) does not match the {fam.name} family"
        )
    if (fam.moe is not None) != bool(config.num_moe_experts):
        raise ConversionError(
            f"num_moe_experts ({config.num_moe_experts}) does not match the {fam.name} family"
        )
    theta = float(args.rotary_base)
    template.update(
        model_type=fam.name,
        architectures=[fam.architecture],
        vocab_size=args.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels,
        rms_norm_eps=config.layernorm_epsilon,
        max_position_embeddings=derived_sizes(args)["max_position_embeddings"],
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        hidden_act="silu",
    )
    template.update({hf_name: getattr(args, name) for name, hf_name, moe in HF_TRAINING_FIELDS
                     if fam.moe is not None or not moe})
    template.pop("rope_theta", None)
    template.pop("rope_scaling", None)
    template["rope_parameters"] = rope_parameters(args, theta)
    if fam.moe is not None:
        pattern = moe_layers_of_freq(config.moe_layer_freq, config.num_layers)
        template.update(num_experts_per_tok=config.moe_router_topk)
        if fam.name == "qwen3_moe":
            template.update(
                num_experts=config.num_moe_experts,
                moe_intermediate_size=config.moe_ffn_hidden_size,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
                norm_topk_prob=not config.moe_router_pre_softmax,
            )
        else:
            unsaid = mixtral_cannot_say(config)
            if unsaid:
                raise ConversionError(
                    "mixtral has an MoE block in every layer and renormalised softmax top-k "
                    f"routing: {unsaid} cannot be exported to it (a model imported from Mixtral "
                    "keeps its family); export a checkpoint without the Mixtral config to get "
                    "the native Qwen3-MoE model, which has them"
                )
            if config.moe_ffn_hidden_size != config.ffn_hidden_size:
                template["intermediate_size"] = config.moe_ffn_hidden_size
            template.update(num_local_experts=config.num_moe_experts)
    if without_qk_norm:
        template["qk_layernorm"] = False
    if byte_level_run(description):  # HF generate stops at the end of a document
        template["eos_token_id"] = ByteLevelTokenizer.EOD
    template["dtype"] = "bfloat16" if args.bf16 else "float32"
    return fam, template
