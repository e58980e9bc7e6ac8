"""Megatron-LM (`pretrain_gpt.py`) integration: flags, GPT builder, checkpoint-args restore.

The only module of megatron_mea that imports `megatron.training` (and the Megatron-LM checkout's
top-level `gpt_builders`); it does so inside the functions that need them, so `add_mea_args` stays
importable from here in CI without Megatron-LM. Targets: Megatron-LM tags `core_v0.16.1`
(commit 55ac7082517c, megatron-core 0.16.x) and `core_v0.19.0` (commit 5be9626709af, megatron-core
0.17 and later); where they differ, the code asks the checkout what it has, not its version.

Usage, from a Megatron-LM checkout on PYTHONPATH: `examples/megatron_lm/pretrain_gpt_mea.py`.
"""

import logging

from megatron_mea.config import MEATransformerConfig
from megatron_mea.integrations.args import add_mea_args, restore_mea_args
from megatron_mea.specs import apply_attention_variant, get_gpt_decoder_block_spec

__all__ = ["add_mea_args", "load_mea_args_from_checkpoint", "mea_gpt_builder"]

logger = logging.getLogger(__name__)

# `mea_gpt_builder` runs once per virtual pipeline stage; the checkpoint is read only once.
_checkpoint_args_restored = False


def load_mea_args_from_checkpoint(args) -> list:
    """With `--use-checkpoint-args`, take the plugin fields from the checkpoint's saved args.

    Megatron-LM saves the whole `args` namespace in every checkpoint (`state_dict['args']`,
    `checkpointing.py`), plugin flags included, but its `load_args_from_checkpoint` copies back only
    a fixed list of its own flags. This reads the same saved namespace, from `--pretrained-checkpoint`
    then `--load` (Megatron-LM's order, so `--load` wins), and applies `restore_mea_args`.

    Args:
        args: Megatron-LM's global args, updated in place.

    Returns:
        `(name, old, new)` for every plugin field that changed.
    """
    if not args.use_checkpoint_args:
        return []
    from megatron.training.checkpointing import _load_base_checkpoint

    changed = []
    for load_arg in ("pretrained_checkpoint", "load"):
        load_dir = getattr(args, load_arg, None)
        if load_dir is None:
            continue
        state_dict, _, _, _ = _load_base_checkpoint(load_dir, args, rank0=True)
        changed += restore_mea_args(args, (state_dict or {}).get("args"))
    for name, old, new in changed:
        logger.info("megatron_mea: setting %s to %r from checkpoint (was %r)", name, new, old)
    return changed


def _check_supported(args) -> None:
    # core_transformer_config_from_args swaps the config class for these, dropping the plugin fields.
    if args.attention_variant == "standard":
        return
    for name in ("yaml_cfg", "heterogeneous_layers_config_path"):
        if getattr(args, name) is not None:
            raise ValueError(
                f"--{name.replace('_', '-')} cannot be combined with --attention-variant "
                f"{args.attention_variant}: it replaces MEATransformerConfig"
            )
    # core_v0.19.0 dropped the flag (and the legacy models) altogether.
    if getattr(args, "use_legacy_models", False):
        raise ValueError("--use-legacy-models has no attention variants; drop it")


def mea_gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's `gpt_builder` with `MEATransformerConfig` and the plugin spec.

    Identical to the core-model branch of `gpt_builders.gpt_builder` (tags core_v0.16.1 and
    core_v0.19.0) except that the config class is `MEATransformerConfig`, every layer spec (the
    `--spec` one, the MoE block spec, the dense layer spec) gets the self-attention of
    `config.attention_variant`, and the MTP layer spec is derived from a swapped spec, so MTP layers
    use the variant too. YAML configs, heterogeneous layers and legacy models are refused with a
    variant, since they bypass the config class; with standard attention the first two are built as
    Megatron-LM builds them. Signature as in Megatron-LM, for `partial(model_provider,
    mea_gpt_builder)`.
    """
    from gpt_builders import _get_transformer_layer_spec  # Megatron-LM checkout root
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav_specs
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
        get_gpt_heterogeneous_layer_spec,
    )
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training import print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    global _checkpoint_args_restored
    print_rank_0("building GPT model (megatron_mea) ...")
    _check_supported(args)
    if not _checkpoint_args_restored:
        load_mea_args_from_checkpoint(args)
        _checkpoint_args_restored = True
    if config is None and args.yaml_cfg is not None:
        # Standard attention only (_check_supported): the config class is Megatron's own.
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        config = core_transformer_config_from_yaml(args, "language_model")
    elif config is None:
        config = core_transformer_config_from_args(args, MEATransformerConfig)

    use_te = args.transformer_impl == "transformer_engine"
    # The decoder block's layer specs and the MTP layer's are built with the same options.
    layer_spec_options = dict(
        use_transformer_engine=use_te,
        normalization=args.normalization,
        qk_l2_norm=args.qk_l2_norm,
        vp_stage=vp_stage,
    )
    if args.spec is not None:
        transformer_layer_spec = apply_attention_variant(import_module(args.spec), config)
    elif args.experimental_attention_variant is not None:
        # MEATransformerConfig refuses a plugin variant together with this one.
        transformer_layer_spec = (
            eav_specs.get_transformer_block_with_experimental_attention_variant_spec(
                config=config, vp_stage=vp_stage
            )
        )
    elif args.num_experts:
        assert not (config.transformer_impl == "inference_optimized")
        transformer_layer_spec = get_gpt_decoder_block_spec(config, **layer_spec_options)
    elif args.heterogeneous_layers_config_path is not None:
        # Standard attention only (_check_supported): the config class is Megatron's own.
        transformer_layer_spec = get_gpt_heterogeneous_layer_spec(config, use_te)
    else:
        transformer_layer_spec = apply_attention_variant(
            _get_transformer_layer_spec(use_te, config), config
        )

    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        assert not (config.transformer_impl == "inference_optimized")
        if (
            hasattr(transformer_layer_spec, "layer_specs")
            and len(transformer_layer_spec.layer_specs) == 0
        ):
            # No decoder layer on this (last) stage of a block spec: build one explicitly.
            spec_for_mtp = _get_transformer_layer_spec(use_te, config)
        elif args.experimental_attention_variant is not None and hasattr(
            eav_specs, "get_transformer_layer_with_experimental_attention_variant_spec"
        ):
            # core_v0.19.0 derives the MTP layer from the experimental variant's own layer specs.
            layer_specs = eav_specs.get_transformer_layer_with_experimental_attention_variant_spec
            spec_for_mtp = layer_specs(config=config)[-1]
        else:
            spec_for_mtp = get_gpt_decoder_layer_specs(config, **layer_spec_options)[-1]
        mtp_block_spec = get_gpt_mtp_block_spec(
            config,
            apply_attention_variant(spec_for_mtp, config),
            use_transformer_engine=use_te,
            vp_stage=vp_stage,
        )

    return GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        # Megatron-LM's builder drops the factor (GPTModel then uses its default, 8); Llama 3.2
        # needs 32.
        rope_scaling_factor=args.rope_scaling_factor,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
