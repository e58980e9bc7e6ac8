"""GPT layer and block specs with the attention variant of an `MEATransformerConfig`.

Megatron's own spec functions build everything (TE or local backend, dense or MoE, q/k norms);
the variants only swap the `self_attention` module, keeping its submodules. Specs are rebuilt, not
mutated, so a spec shared elsewhere is never changed behind its owner's back.

`core_attention` picks the core attention of the local (non-TE) spec: `"megatron"` (default,
Megatron's unfused `DotProductAttention`) or `"sdpa"` (`SDPADotProductAttention`, the same function
on torch's fused `scaled_dot_product_attention`; `layers/sdpa_attention.py`). The TE spec always
uses Transformer Engine's own.
"""

import dataclasses
from typing import Optional, Union

from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_mea._optional import require
from megatron_mea.compat import legacy_grouped_gemm_kwargs
from megatron_mea.layers import KHASelfAttention, MEASelfAttention
from megatron_mea.layers.sdpa_attention import SDPADotProductAttention

_ATTENTION_MODULES = {"standard": SelfAttention, "mea": MEASelfAttention, "kha": KHASelfAttention}
# `core_attention` choices of the local spec -> the module class.
CORE_ATTENTIONS = {"megatron": DotProductAttention, "sdpa": SDPADotProductAttention}


def attention_module(config) -> type:
    """The self-attention class for `config.attention_variant` (plain configs: `SelfAttention`)."""
    return _ATTENTION_MODULES[getattr(config, "attention_variant", "standard")]


def _swap_layer(layer_spec: ModuleSpec, module: type) -> ModuleSpec:
    attention = layer_spec.submodules.self_attention
    if attention.module not in (SelfAttention, module):
        raise ValueError(
            f"cannot apply an attention variant to {attention.module.__name__}: only Megatron's "
            "SelfAttention is supported"
        )
    submodules = dataclasses.replace(
        layer_spec.submodules, self_attention=dataclasses.replace(attention, module=module)
    )
    return dataclasses.replace(layer_spec, submodules=submodules)


def apply_attention_variant(
    spec: Union[ModuleSpec, TransformerBlockSubmodules], config
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """Return `spec` (a layer spec or a block spec) with the self-attention of `config`'s variant.

    Megatron shares one spec object between all layers of a kind; the copy keeps that sharing.
    """
    module = attention_module(config)
    if module is SelfAttention:
        return spec
    return _map_layers(spec, lambda layer_spec: _swap_layer(layer_spec, module))


def _map_layers(spec, swap):
    """`swap` applied to a layer spec, or to every layer spec of a block spec. Megatron shares one
    spec object between all layers of a kind; each distinct one is swapped once, so the copy keeps
    that sharing."""
    if not isinstance(spec, TransformerBlockSubmodules):
        return swap(spec)
    swapped = {}
    for layer_spec in spec.layer_specs:
        if id(layer_spec) not in swapped:
            swapped[id(layer_spec)] = swap(layer_spec)
    return dataclasses.replace(spec, layer_specs=[swapped[id(ls)] for ls in spec.layer_specs])


def _check_core_attention(core_attention: str, use_transformer_engine: bool) -> None:
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(
            f"core_attention must be one of {sorted(CORE_ATTENTIONS)}, got {core_attention!r}"
        )
    if use_transformer_engine and core_attention != "megatron":
        raise ValueError(
            f"core_attention={core_attention!r} applies to the local spec only "
            "(use_transformer_engine=False); the TE spec uses TEDotProductAttention"
        )


def _swap_core_attention_of_layer(layer_spec: ModuleSpec, module: type) -> ModuleSpec:
    attention = layer_spec.submodules.self_attention
    current = getattr(attention.submodules, "core_attention", None)
    if current is module:
        return layer_spec
    if current is not DotProductAttention:
        name = getattr(current, "__name__", repr(current))
        raise ValueError(
            f"cannot replace the core attention {name} by {module.__name__}: only Megatron's "
            "local DotProductAttention is replaced"
        )
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=module)
    )
    submodules = dataclasses.replace(layer_spec.submodules, self_attention=attention)
    return dataclasses.replace(layer_spec, submodules=submodules)


def apply_core_attention(
    spec: Union[ModuleSpec, TransformerBlockSubmodules], core_attention: str = "megatron"
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """Return `spec` (a local layer or block spec) with `core_attention`'s module (a copy; a
    shared layer spec stays shared). `"megatron"` returns `spec` itself."""
    _check_core_attention(core_attention, use_transformer_engine=False)
    module = CORE_ATTENTIONS[core_attention]
    if module is DotProductAttention:
        return spec
    return _map_layers(spec, lambda layer_spec: _swap_core_attention_of_layer(layer_spec, module))


def get_gpt_layer_spec(
    config,
    use_transformer_engine: bool = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = None,
    qk_layernorm: Optional[bool] = None,
    normalization: Optional[str] = None,
    qk_l2_norm: bool = False,
    use_te_op_fuser: bool = False,
    core_attention: str = "megatron",
) -> ModuleSpec:
    """One GPT layer spec with `config`'s attention variant.

    The plugin's counterpart of `get_gpt_layer_with_transformer_engine_spec` /
    `get_gpt_layer_local_spec`; every argument left as None is read from `config`.

    Args:
        config: an `MEATransformerConfig` (a plain `TransformerConfig` gives standard attention).
        use_transformer_engine: TE modules (needs the `te` extra) or Megatron's local ones.
        num_experts: MoE experts. Default: `config.num_moe_experts`; 0 builds a dense layer.
        moe_grouped_gemm: default `config.moe_grouped_gemm`.
        qk_layernorm: default `config.qk_layernorm`.
        normalization: local backend only; default `config.normalization`.
        qk_l2_norm: L2-normalise q and k.
        use_te_op_fuser: TE backend only.
        core_attention: local backend only: `"megatron"` (Megatron's unfused DotProductAttention)
            or `"sdpa"` (torch's `scaled_dot_product_attention`, same function).
    """
    _check_core_attention(core_attention, use_transformer_engine)
    # Megatron's builders take None for "dense"; here None means "as the config says".
    num_experts = config.num_moe_experts if num_experts is None else (num_experts or None)
    moe_grouped_gemm = config.moe_grouped_gemm if moe_grouped_gemm is None else moe_grouped_gemm
    qk_layernorm = config.qk_layernorm if qk_layernorm is None else qk_layernorm
    common = dict(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        qk_l2_norm=qk_l2_norm,
        use_kitchen=config.use_kitchen,
        **legacy_grouped_gemm_kwargs(config),
    )
    if use_transformer_engine:
        require("transformer_engine", "use_transformer_engine=True")
        spec = mcore_specs.get_gpt_layer_with_transformer_engine_spec(
            **common,
            use_te_op_fuser=use_te_op_fuser,
            use_te_activation_func=config.use_te_activation_func,
        )
    else:
        spec = mcore_specs.get_gpt_layer_local_spec(
            **common, normalization=normalization or config.normalization
        )
        spec = apply_core_attention(spec, core_attention)
    return apply_attention_variant(spec, config)


def get_gpt_decoder_block_spec(
    config,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    core_attention: str = "megatron",
) -> TransformerBlockSubmodules:
    """Megatron-Core's `get_gpt_decoder_block_spec` (same signature; dense and MoE layers by
    `config.moe_layer_freq`, this pipeline stage's slice) with `config`'s attention variant, and
    (local backend) the core attention `core_attention` (`"megatron"` or `"sdpa"`)."""
    _check_core_attention(core_attention, use_transformer_engine)
    if use_transformer_engine:
        require("transformer_engine", "use_transformer_engine=True")
    spec = mcore_specs.get_gpt_decoder_block_spec(
        config,
        use_transformer_engine,
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    if not use_transformer_engine:
        spec = apply_core_attention(spec, core_attention)
    return apply_attention_variant(spec, config)
