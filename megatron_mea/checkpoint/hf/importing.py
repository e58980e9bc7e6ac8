"""Import a Hugging Face checkpoint into a `torch_dist` Megatron checkpoint of `mea-pretrain`.

Upcycling: the model can be imported as the baseline, as MEA (identity mixing; head norm
optional) or as KHA (identity transforms), for continued pretraining. The output loads at any
TP / PP / EP (`mea-pretrain --config <out>/config.yaml --load <out> ...`).

Streaming: tensors are read from the safetensors files one at a time and converted one layer at
a time (see `torch_dist.layerwise` for what the writer keeps in memory).
"""

import logging
import os
from typing import Dict, List, Optional

import torch

from megatron_mea.checkpoint.hf.config import description_from_hf, split_model_type
from megatron_mea.checkpoint.torch_dist.layerwise import write_checkpoint
from megatron_mea.checkpoint.hf.families import (
    VARIANT_PARAMS,
    Family,
    Layout,
    Rule,
    family,
    model_rules,
)
from megatron_mea.checkpoint.hf.files import HFReader, has_tokenizer, load_hf_config
from megatron_mea.checkpoint.torch_dist.model_only import (
    ConversionError,
    ModelDescription,
    converter_process,
    expected_shapes,
    layer_of,
)
from megatron_mea.checkpoint.torch_dist.output_dir import check_new_directory
from megatron_mea.checkpoint.transforms.plugin_params import upcycle_init

logger = logging.getLogger(__name__)


def qkv_layout(description: ModelDescription, num_kv_heads: Optional[int] = None) -> Layout:
    """Sizes of the `linear_qkv` layout of the model (K/V heads: MEA's nc, else ng)."""
    config = description.config
    if num_kv_heads is None:
        num_kv_heads = (
            config.mea_num_kv_components
            if config.attention_variant == "mea"
            else config.num_query_groups
        )
    return Layout(
        num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=config.kv_channels,
        vocab_size=description.args.vocab_size,
        padded_vocab_size=description.args.padded_vocab_size,
    )


def plan_rules(description: ModelDescription, shapes: Dict, with_variant_params: bool,
               fam: Optional[Family] = None):
    """Rules of every tensor of the model, by layer (-1: embedding, final norm, output).

    Args:
        description: the model.
        shapes: its tensors' shapes (`expected_shapes`).
        with_variant_params: map the plugin's parameters too (the native format).
        fam: the HF family. Default: the one of `description.hf_config`.

    Returns:
        layer -> the rules of its tensors (`hf_families.model_rules`).

    Raises:
        ConversionError: a layer's tensors disagree with `description.moe_layers` (names the
            layer).
    """
    fam = fam or family((description.hf_config or {}).get("model_type", ""))
    config = description.config
    for layer, is_moe in enumerate(description.moe_layers):
        if (f"decoder.layers.{layer}.mlp.router.weight" in shapes) != is_moe:
            raise ConversionError(
                f"layer {layer}: moe_layer_freq makes it {'an MoE' if is_moe else 'a dense'} "
                "layer, the model's tensors say otherwise"
            )
    variant = {}
    if with_variant_params:
        for name in shapes:
            for param in VARIANT_PARAMS:
                if name.endswith(".self_attention." + param):
                    variant.setdefault(layer_of(name), []).append(param)
    return model_rules(
        fam,
        config.num_layers,
        list(description.moe_layers),
        config.num_moe_experts or 0,
        tied=not description.args.untie_embeddings_and_output_weights,
        variant_params=variant,
        megatron_moe=tuple(
            name for name in shapes if ".mlp.router.expert_bias" in name
            or ".mlp.shared_experts." in name
        ) if fam.name == "qwen3_moe" and with_variant_params else (),
        qk_layernorm=bool(config.qk_layernorm),
    )


def expected_hf_shapes(rule: Rule, layout: Layout, megatron_shape) -> List:
    """Shapes of a rule's HF tensors implied by the Megatron tensor's shape."""
    meta = torch.empty(megatron_shape, device="meta")
    return [tuple(t.shape) for t in rule.transform.to_hf(layout, meta)]


def import_hf_checkpoint(
    hf_dir: str,
    save_dir: str,
    *,
    dtype: Optional[torch.dtype] = None,
    parallel: Optional[Dict[str, int]] = None,
    **model_options,
) -> ModelDescription:
    """Convert the HF checkpoint in `hf_dir` into a Megatron checkpoint under `save_dir`.

    Args:
        hf_dir: HF directory (config.json + safetensors): Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
            or one of our native MEA / KHA exports.
        save_dir: output root, new or empty (`iter_0000000/`, tracker, `config.yaml`,
            `conversion.json`); written under a temporary name and renamed at the end.
        dtype: parameter dtype of the checkpoint. Default: the HF config's (bf16 or fp32).
        parallel: parallel sizes to record in `config.yaml` (validated against the model), e.g.
            `{"tensor_model_parallel_size": 2}`; the checkpoint itself loads at any layout.
        model_options: `description_from_hf`'s: the variant to upcycle to (`attention_variant`
            "standard", "mea" with identity mixing and nc = ng, or "kha" with identity
            transforms; `mea_head_norm` adds the head norm with scale 1, which changes the
            function; `kha_variant`, `kha_targets`) and `make_vocab_size_divisible_by`.

    Returns:
        The description of the written model.

    Raises:
        ConversionError: `save_dir` is not new or empty (checked first); config.json is
            malformed or unsupported; tensors are missing, unexpected, of another shape or not
            floating-point. Nothing is left under `save_dir` then.
    """
    check_new_directory(save_dir)
    config = load_hf_config(hf_dir)
    _, native = split_model_type(config.model_type)
    description = description_from_hf(
        config,
        dtype=dtype,
        tokenizer_dir=os.path.abspath(hf_dir) if has_tokenizer(hf_dir) else None,
        parallel=parallel,
        **model_options,
    )
    description.source = os.path.abspath(hf_dir)
    dtype = torch.bfloat16 if description.args.bf16 else torch.float32
    if dtype == torch.float32 and str(getattr(config, "dtype", "")).endswith("16"):
        logger.warning("storing the %s checkpoint in float32", getattr(config, "dtype", ""))
    reader = HFReader(hf_dir)
    with converter_process():
        shapes = expected_shapes(description)
        layout = qkv_layout(description)
        groups = plan_rules(description, shapes, with_variant_params=native)

        def produce():
            for layer in sorted(groups):
                out = {}
                for rule in groups[layer]:
                    want = expected_hf_shapes(rule, layout, shapes[rule.megatron])
                    tensors = [reader.get(n, shape) for n, shape in zip(rule.hf, want, strict=True)]
                    out[rule.megatron] = rule.transform.to_megatron(layout, *tensors).to(dtype)
                for name in shapes:
                    if layer_of(name) == layer and name not in out:
                        out[name] = upcycle_init(name, shapes[name], dtype)
                yield out
            _check_unused(reader, description)

        write_checkpoint(save_dir, description, produce())
    return description


def _check_unused(reader: HFReader, description: ModelDescription) -> None:
    unused = reader.unused()
    tied = not description.args.untie_embeddings_and_output_weights
    if tied and "lm_head.weight" in unused:
        # Some tied checkpoints still store the output layer: accept it only as a true copy.
        if not torch.equal(reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
            raise ConversionError(
                f"{reader.directory}: tie_word_embeddings is set but lm_head.weight differs from "
                "model.embed_tokens.weight"
            )
        unused.remove("lm_head.weight")
    if unused:
        raise ConversionError(
            f"{reader.directory}: {len(unused)} tensors are not part of the model the config "
            f"describes, e.g. {unused[0]!r} {list(reader.shape(unused[0]))}"
        )
