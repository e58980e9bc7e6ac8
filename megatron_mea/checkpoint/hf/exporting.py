"""Export a Megatron checkpoint (any TP / PP / EP it was saved at) to a Hugging Face directory.

Formats:
- `plain`: the stock family architecture (`LlamaForCausalLM`, `Qwen3MoeForCausalLM`...), which
  stock `transformers` loads. The baseline is exported exactly; MEA without the head norm and
  KHA-Linear are folded into the q/k/v weights (`variants.fold_layer`).
- `native`: our modeling code (`megatron_mea.integrations.transformers`, model type
  `megatron_mea_<family>`) keeps the
  plugin's parameters; needed for MEA with the head norm and for KHA-MLP. The export carries the
  modeling files and an `auto_map`, so `trust_remote_code=True` also works.
- `auto` (default): `plain` when the variant folds, else `native`.

Tensors are read one layer at a time and written to safetensors shards as they fill.
"""

import itertools
import logging
import os
import shutil
import time
from typing import Optional

import torch

from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from megatron_mea.checkpoint.hf.config import (
    NATIVE_PREFIX,
    VARIANT_FIELDS,
    byte_level_run,
    dtype_name,
    StockLimits,
    hf_config_dict,
    split_model_type,
    stock_limits,
)
from megatron_mea.checkpoint.hf.fields import settings_left_out
from megatron_mea.checkpoint.hf.files import HFWriter, copy_tokenizer, load_hf_config
from megatron_mea.checkpoint.hf.importing import plan_rules, qkv_layout
from megatron_mea.checkpoint.torch_dist.model_only import (
    ConversionError,
    ModelDescription,
    converter_process,
    expected_shapes,
    layer_name,
)
from megatron_mea.checkpoint.torch_dist.output_dir import check_new_directory, staged_directory
from megatron_mea.checkpoint.transforms.plugin_params import fold_layer, foldable
from megatron_mea.data.tokenizers import ByteLevelTokenizer
from megatron_mea.variant import variant_settings

logger = logging.getLogger(__name__)

FORMATS = ("auto", "plain", "native")
_NATIVE_FILES = ("configuration_megatron_mea.py", "modeling_megatron_mea.py")


def choose_format(description: ModelDescription, limits: StockLimits,
                  requested: str = "auto") -> str:
    """`plain` or `native` for the model of `description` (`limits`: its `stock_limits`)."""
    config = description.config
    if requested not in FORMATS:
        raise ValueError(f"format ({requested!r}) must be one of {FORMATS}")
    if limits.router and requested == "plain":
        raise ConversionError(
            f"{limits.router}: no stock transformers family routes this way; use "
            "format 'native' (megatron_mea.integrations.transformers's MegatronRouter)"
        )
    if limits.router:
        return "native"
    unsaid = limits.native_qwen3_moe
    if unsaid and requested == "plain":
        raise ConversionError(
            f"{unsaid}: without qk_layernorm the stock MoE family is Mixtral, which cannot say "
            "this; use format 'native' (megatron_mea.integrations.transformers's Qwen3-MoE "
            "without QK norm)"
        )
    if unsaid:
        return "native"
    if config.attention_variant == "standard":
        return "plain"
    if requested == "auto":
        return "plain" if foldable(config) else "native"
    if requested == "plain" and not foldable(config):
        raise ConversionError(
            f"attention_variant={config.attention_variant!r} with mea_head_norm="
            f"{config.mea_head_norm} / mea_key_norm_before_mix="
            f"{config.mea_key_norm_before_mix} / kha_variant={config.kha_variant!r} does not "
            "fold into a stock architecture; use format 'native' "
            "(megatron_mea.integrations.transformers modeling code)"
        )
    return requested


# Sizes a `reference` config.json must agree with: the export rewrites them from the checkpoint,
# and a reference of another model leaves per-layer fields of the wrong length (`layer_types`).
REFERENCE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim")


def _reference_config(path: str) -> dict:
    config = load_hf_config(path).to_dict()
    fam, _ = split_model_type(config["model_type"])
    for name in VARIANT_FIELDS + ("auto_map",):
        config.pop(name, None)
    config.update(model_type=fam.name, architectures=[fam.architecture])
    return config


def _check_reference(path: str, reference: dict, fields: dict) -> None:
    for name in REFERENCE_SIZES:
        if reference.get(name) is not None and reference[name] != fields.get(name):
            raise ConversionError(
                f"{os.path.join(path, 'config.json')}: {name} is {reference[name]}, the "
                f"checkpoint's model has {fields.get(name)} (the reference must describe the "
                "exported model)"
            )


def _build_config(fam, fields: dict, config, fmt: str):
    """The transformers config object of the export (validated by transformers).

    Raises:
        ConversionError: transformers refuses the fields (one line).
    """
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if k != "model_type"}
    try:
        if fmt == "plain":
            return AutoConfig.for_model(fam.name, **fields)
        # Importing it registers the native model types.
        from megatron_mea.integrations.transformers import CONFIGS, MODELS
        from megatron_mea.integrations.transformers.configuration_megatron_mea import ROUTER_FIELDS

        model_type = NATIVE_PREFIX + fam.name
        # Every variant field, as the config resolved it: the modeling code has no defaults of
        # its own to disagree with.
        variant = {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in variant_settings(config, scopes=("model",)).items()
            if name in VARIANT_FIELDS
        }
        if fam.name == "qwen3_moe":  # Megatron's router, as the checkpoint routes
            variant.update({name: getattr(config, name) for name in ROUTER_FIELDS})
        fields = dict(fields, architectures=[MODELS[model_type].__name__], **variant)
        native = CONFIGS[model_type](**fields)
    except Exception as exc:  # transformers' validators raise their own error types
        raise ConversionError(
            f"the {fam.name} config.json of the export is invalid: {' '.join(str(exc).split())}"
        ) from exc
    native.auto_map = {
        "AutoConfig": f"configuration_megatron_mea.{CONFIGS[model_type].__name__}",
        "AutoModelForCausalLM": f"modeling_megatron_mea.{MODELS[model_type].__name__}",
    }
    return native


def _write_config(save_dir: str, built, fmt: str, dtype: torch.dtype) -> None:
    built.dtype = dtype_name(dtype)
    built.save_pretrained(save_dir)
    if fmt == "native":  # the modeling code, for trust_remote_code=True
        import megatron_mea.integrations.transformers

        package = os.path.dirname(megatron_mea.integrations.transformers.__file__)
        for name in _NATIVE_FILES:
            shutil.copy(os.path.join(package, name), os.path.join(save_dir, name))


def export_hf_checkpoint(
    load_dir: str,
    save_dir: str,
    *,
    format: str = "auto",  # noqa: A002 -- the CLI flag's name
    reference: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    iteration: Optional[int] = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> str:
    """Write the model of the Megatron checkpoint under `load_dir` as an HF directory.

    Everything is checked before the first tensor is read, and the directory is written under a
    temporary name next to `save_dir` and renamed at the end: a failed export leaves nothing.

    Args:
        load_dir: checkpoint root (`latest_checkpointed_iteration.txt`, `config.yaml`).
        save_dir: output HF directory, new or empty (config.json, safetensors, tokenizer files
            if known).
        format: `auto`, `plain` or `native` (module docstring).
        reference: an HF directory whose config.json is the template (e.g. the model a run was
            upcycled from, when the run's directory has no `conversion.json`); its sizes must
            be the checkpoint's. Default: the checkpoint's `conversion.json`, else a config
            built from the model's sizes.
        dtype: output dtype. Default: the checkpoint's.
        iteration: checkpoint to export. Default: the latest.
        max_shard_bytes: safetensors shard size limit.

    Returns:
        The format written (`plain` or `native`).

    Raises:
        ConversionError: `save_dir` is not new or empty; the reference or the model cannot be
            expressed in the family's config; a checkpoint tensor has no export rule.
        CheckpointError: the checkpoint is missing, partial or does not match its config.
    """
    check_new_directory(save_dir)
    description = ModelDescription.load(load_dir)
    reference_fields = _reference_config(reference) if reference else None
    if reference_fields:
        description.hf_config = reference_fields
    config = description.config
    limits = stock_limits(description)  # read by the format and the family's checks
    fmt = choose_format(description, limits, format)
    for name in ("mea_num_kv_components_per_layer", "attention_variant_per_layer"):
        if fmt == "native" and getattr(config, name, None) is not None:
            raise ConversionError(
                f"{name}: a native export has one setting for all layers; export without the "
                "head norm (folded to plain q/k/v) or compress all layers"
            )
    fam, fields = hf_config_dict(description, limits)
    left_out = settings_left_out(description.args)
    if left_out:
        logger.warning("the %s config has no field for %s: a model imported from this export "
                       "trains with the defaults", fam.name, ", ".join(left_out))
    if reference_fields:
        _check_reference(reference, reference_fields, fields)
    built = _build_config(fam, fields, config, fmt)  # refused before any tensor is read
    started = time.perf_counter()
    with staged_directory(save_dir) as staged:
        _write_export(load_dir, staged, description, fam, fmt, built, dtype, iteration,
                      max_shard_bytes)
    logger.info("wrote %s (%s format, %.1f s)", save_dir, fmt, time.perf_counter() - started)
    return fmt


def _write_tokenizer(description: ModelDescription, save_dir: str) -> None:
    args = description.args
    source = args.tokenizer_model if args.tokenizer_type == "HuggingFaceTokenizer" else None
    copied = copy_tokenizer(source or description.source, save_dir)
    if not copied and byte_level_run(description):
        ByteLevelTokenizer().save_hf(save_dir)  # needs no file: every export has a tokenizer


def _write_export(load_dir, save_dir, description, fam, fmt, built, dtype, iteration,
                  max_shard_bytes) -> None:
    """Write the export under `save_dir`: config.json (and the modeling files of a native
    export) and the tokenizer, then the checkpoint's tensors streamed through the family's
    export rules into safetensors shards."""
    started = time.perf_counter()
    config = description.config
    with converter_process():
        native = fmt == "native"
        rules = plan_rules(description, expected_shapes(description), native, fam)
        layout = qkv_layout(description, None if native else config.num_query_groups)
        _, groups = read_checkpoint(load_dir, description, iteration)
        # The first layer read (the embedding) tells the saved dtype, which config.json names.
        first = next(groups)
        saved_dtype = next(iter(first[1].values())).dtype
        _write_config(save_dir, built, fmt, dtype or saved_dtype)
        _write_tokenizer(description, save_dir)
        writer = HFWriter(save_dir, max_shard_bytes)
        for layer, tensors in itertools.chain([first], groups):
            if not native and layer >= 0:
                tensors = fold_layer(tensors, layer, config)
            hf = {}
            for rule in rules[layer]:
                outputs = rule.transform.to_hf(layout, tensors.pop(rule.megatron))
                hf.update(zip(rule.hf, outputs, strict=True))
            if tensors:
                raise ConversionError(
                    f"no {fmt} export rule for {sorted(tensors)[0]!r} of the {fam.name} family"
                )
            writer.add({k: v.to(dtype) if dtype else v for k, v in hf.items()})
            logger.info("exported %s (%.1f s)", layer_name(layer), time.perf_counter() - started)
        writer.close()
