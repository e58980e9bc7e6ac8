"""Hugging Face `config.json` <-> the Megatron model description (`RunArgs`).

The correspondence of the fields is the table of `fields.py`; this module chooses the family
and assembles the config (export) or the description (import) from it. Import refuses what the
Megatron model cannot compute the same way (`fields.FIXED`, RoPE scaling other than Megatron's
llama3 form), naming the config field. Export rebuilds the family's config: from the imported
`config.json` when there is one (checked against the Megatron model), otherwise from the
model's sizes.

Vocabulary: the embedding and output rows are padded to a multiple of
`make_vocab_size_divisible_by` (128 by default, as Megatron-LM), recorded with the true
`vocab_size` in `config.yaml`; export strips the padding rows again.
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_mea.checkpoint.hf.families import FAMILIES, Family, family
from megatron_mea.checkpoint.hf.fields import CARRIED, FIXED, of_family, rope_settings
from megatron_mea.checkpoint.errors import ConversionError
from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription
from megatron_mea.data.tokenizers import ByteLevelTokenizer
from megatron_mea.model.args import RUN_FIELDS, RunArgs
from megatron_mea.variant import fields_of_scope

NATIVE_PREFIX = "megatron_mea_"
_ARG_FIELDS = set(RUN_FIELDS)
# The variant fields a native `megatron_mea_*` config.json carries (resolved, never None where
# they apply): the model-scope fields of `megatron_mea.variant`, less the per-layer ones (a
# native export has one setting for all layers).
VARIANT_FIELDS = tuple(name for name in fields_of_scope("model") if not name.endswith("_per_layer"))
# HF fields that older configs spell separately and `rope_parameters` replaces.
_SUPERSEDED = ("rope_theta", "rope_scaling")


def byte_level_run(description: ModelDescription) -> bool:
    """Whether the model was trained from scratch on `ByteLevelTokenizer` ids (an import keeps
    the tokenizer files of its HF source instead): its export gets the equal HF tokenizer and
    `<eod>` as the end-of-sequence token."""
    return description.args.tokenizer_type == "ByteLevelTokenizer" and not description.hf_config


@dataclass(frozen=True)
class StockLimits:
    """What the stock transformers families cannot say of a model (`stock_limits`), answered
    once per export: the format, the family and its checks read it.

    Attributes:
        router: `field (value)` of the first router setting no stock family computes
            (`router_outside_stock`), or None.
        mixtral: what Mixtral (an MoE block in every layer, softmax over the top-k logits)
            cannot say of the MoE model, or None (also for a dense model).
        native_qwen3_moe: why an MoE model without QK norm needs the native Qwen3-MoE config
            (its `qk_layernorm` field false): what Mixtral, the stock family without QK norm,
            cannot say; or None.
    """

    router: Optional[str] = None
    mixtral: Optional[str] = None
    native_qwen3_moe: Optional[str] = None


def stock_limits(description: ModelDescription) -> StockLimits:
    """The `StockLimits` of the model of `description`."""
    # Imported here: megatron_mea.integrations.transformers needs the `hf` extra, this module
    # only when converting.
    from megatron_mea.integrations.transformers.configuration_megatron_mea import (
        router_outside_stock)

    config = description.config
    if not config.num_moe_experts:
        return StockLimits()
    router = router_outside_stock(config)
    router = f"{router[0]} ({router[1]!r})" if router else None
    if not all(description.moe_layers):
        mixtral = f"moe_layer_freq ({config.moe_layer_freq})"
    elif config.moe_router_pre_softmax:
        mixtral = "moe_router_pre_softmax (True)"
    else:
        mixtral = router
    return StockLimits(router, mixtral, None if config.qk_layernorm else mixtral)


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


def check_supported(fam: Family, config) -> None:
    """Raise ConversionError for HF settings the Megatron model would compute differently."""
    for fixed in of_family(FIXED, fam.name):
        fixed.refuse(config)
    rope_settings(config)
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConversionError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )


def _native_variant(config) -> Dict:
    variant = {name: getattr(config, name, None) for name in VARIANT_FIELDS}
    missing = [name for name, value in variant.items() if value is None
               and name in ("attention_variant", "mea_head_norm", "mea_hlc")]
    if missing:
        raise ConversionError(
            f"{config.model_type} config.json lacks {', '.join(missing)} (a native export "
            "writes every variant field)"
        )
    return variant


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
        variant = _native_variant(config)
    if variant.get("kha_targets") is not None:
        variant["kha_targets"] = list(variant["kha_targets"])
    tp = (parallel or {}).get("tensor_model_parallel_size") or 1
    # What the family itself says (`fields.NOT_CARRIED`), then every carried field.
    fields = dict(
        normalization="RMSNorm",
        qk_layernorm=getattr(config, "qk_layernorm", fam.qk_layernorm) if native
        else fam.qk_layernorm,
        swiglu=True,
        position_embedding_type="rope",
        add_qkv_bias=fam.add_qkv_bias,
        num_experts=None,
        **variant,
        make_vocab_size_divisible_by=vocab_multiple(make_vocab_size_divisible_by, tp),
        **(parallel or {}),
    )
    for carried in of_family(CARRIED, fam.name):
        fields.update(carried.to_run(config))
    fields["seq_length"] = min(fields["max_position_embeddings"], 4096)
    if dtype is not None:
        fields["bf16"] = dtype == torch.bfloat16
    if tokenizer_dir:
        fields.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    if native and fam.moe is not None and getattr(config, "moe_router_score_function", None):
        from megatron_mea.integrations.transformers.configuration_megatron_mea import ROUTER_FIELDS

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
    description.run_config()  # validates the parallel sizes
    return description


def _family_for(description: ModelDescription, limits: StockLimits) -> Family:
    """The family of a model trained from scratch (no HF config to follow)."""
    args = description.args
    if description.config.add_qkv_bias:
        return FAMILIES["qwen2"]
    if args.num_experts:
        native_qwen3_moe = args.qk_layernorm or limits.native_qwen3_moe
        return FAMILIES["qwen3_moe" if native_qwen3_moe else "mixtral"]
    return FAMILIES["qwen3" if args.qk_layernorm else "llama"]


def _check_family(fam: Family, description: ModelDescription, limits: StockLimits
                  ) -> Optional[str]:
    """Raise ConversionError where the family cannot express the model of `description`;
    returns why the native Qwen3-MoE model leaves out QK norm, or None."""
    config = description.config
    for name, value, wanted in (
        ("swiglu", description.args.swiglu, True),
        ("normalization", config.normalization, "RMSNorm"),
        ("position_embedding_type", description.args.position_embedding_type, "rope"),
        ("add_bias_linear", config.add_bias_linear, False),
    ):
        if value != wanted:
            raise ConversionError(
                f"{name} ({value!r}) cannot be exported: the {fam.name} family needs {wanted!r}"
            )
    # The native Qwen3-MoE model drops q_norm / k_norm when its config says qk_layernorm false
    # (an MoE model without QK norm that Mixtral cannot express).
    without_qk_norm = limits.native_qwen3_moe if fam.name == "qwen3_moe" else None
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
    if fam.name == "mixtral" and limits.mixtral:
        raise ConversionError(
            "mixtral has an MoE block in every layer and renormalised softmax top-k "
            f"routing: {limits.mixtral} cannot be exported to it (a model imported from "
            "Mixtral keeps its family); export a checkpoint without the Mixtral config to get "
            "the native Qwen3-MoE model, which has them"
        )
    return without_qk_norm


def hf_config_dict(description: ModelDescription, limits: StockLimits) -> Tuple[Family, Dict]:
    """The family and the stock HF config fields of the model of `description` (`limits`: its
    `stock_limits`).

    Starts from the imported HF config when there is one; every carried field
    (`fields.CARRIED`) and every fixed one (`fields.FIXED`) is (re)written from the
    description, and a family that cannot express the model is refused.
    """
    template = dict(description.hf_config or {})
    fam = family(template["model_type"]) if template else _family_for(description, limits)
    without_qk_norm = _check_family(fam, description, limits)
    template.update(model_type=fam.name, architectures=[fam.architecture])
    for name in _SUPERSEDED:
        template.pop(name, None)
    for carried in of_family(CARRIED, fam.name):
        template.update(carried.to_hf(description.resolved, description.moe_layers))
    template.update({fixed.hf: fixed.value for fixed in of_family(FIXED, fam.name)})
    if without_qk_norm:
        template["qk_layernorm"] = False
    if byte_level_run(description):  # HF generate stops at the end of a document
        template["eos_token_id"] = ByteLevelTokenizer.EOD
    return fam, template
