"""GPT layer and block specs with the attention variant of an `MEATransformerConfig`.

Megatron's own spec functions build everything (TE or local backend, dense or MoE, q/k norms);
the variants only swap the `self_attention` module, keeping its submodules. Specs are rebuilt, not
mutated, so a spec shared elsewhere is never changed behind its owner's back. With
`multi_latent_attention`, KHA swaps Megatron's `MLASelfAttention` for `KHAMLASelfAttention`
(`layers/kha_mla.py`).

`core_attention` picks the core attention of the local (non-TE) spec: `"megatron"` (default,
Megatron's unfused `DotProductAttention`) or `"sdpa"` (`SDPADotProductAttention`, the same function
on torch's fused `scaled_dot_product_attention`; `layers/sdpa_attention.py`). The TE spec always
uses Transformer Engine's own.
"""

import dataclasses
from typing import Dict, Optional, Union

from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_mea._optional import require
from megatron_mea.compat import bind_te_general_gemm_without_te, legacy_grouped_gemm_kwargs
from megatron_mea.layers import (
    HeadMix,
    HeadRMSNorm,
    KHASelfAttention,
    KHASelfAttentionSubmodules,
    KnockingHeads,
    MEASelfAttention,
    MEASelfAttentionSubmodules,
    head_normed_projection,
)
from megatron_mea.layers.kha_mla import (
    KHAMLASelfAttention,
    KHAMLASelfAttentionSubmodules,
    MLAKnockingHeads,
    MLASDPADotProductAttention,
)
from megatron_mea.layers.sdpa_attention import SDPADotProductAttention
from megatron_mea.variant import AttentionVariantFields

_ATTENTION_MODULES = {"standard": SelfAttention, "mea": MEASelfAttention, "kha": KHASelfAttention}
# Megatron's MLA module -> the variant's MLA counterpart (the config admits KHA only).
_MLA_MODULES = {KHASelfAttention: KHAMLASelfAttention}
# `core_attention` choices of the local spec -> the module class.
CORE_ATTENTIONS = {"megatron": DotProductAttention, "sdpa": SDPADotProductAttention}
# ... and its MLA counterpart (MLA's q/k and v heads differ in size).
_MLA_CORE_ATTENTIONS = {SDPADotProductAttention: MLASDPADotProductAttention}


def attention_module(config, layer_number: Optional[int] = None) -> type:
    """The self-attention class of `config`'s variant (plain configs: `SelfAttention`): of layer
    `layer_number` (1-based, global; `variant_of` answers which variant) when given, else the
    class a spec of all layers holds (`PerLayerSelfAttention` where the layers differ)."""
    if not isinstance(config, AttentionVariantFields):  # a plain TransformerConfig
        return SelfAttention
    if layer_number is not None:
        return _ATTENTION_MODULES[config.variant_of(layer_number)]
    variants = config.variants_in_use()
    if len(variants) > 1:
        return PerLayerSelfAttention
    return _ATTENTION_MODULES[variants.pop()]


class PerLayerSelfAttention:
    """Spec module of models whose layers differ in attention variant
    (`attention_variant_per_layer`): builds the class of each layer's variant.

    Megatron builds a layer's attention with its global `layer_number` whatever the pipeline
    layout, so choosing here (rather than by the position of a spec in a stage's list) stays
    right under PP, virtual PP and custom layouts. The object built is an instance of the chosen
    class, never of this one: `submodules` (`PerLayerSelfAttentionSubmodules`) holds the spec of
    each class a layer may have, and this spec's `params` apply to every layer.

    Why a class with a `__new__` rather than a spec per layer: Megatron-LM's dense path, `--spec`
    and the MTP block share one layer spec between every layer of every pipeline stage, and only
    the build call knows a layer's global number (`TransformerLayer` adds the stage's offset).
    Megatron's `build_module` calls only classes (a function in a spec is returned uncalled, as
    activation functions are), and a wrapper module would add a level to every checkpoint key."""

    def __new__(cls, config, submodules, layer_number, *args, **kwargs):
        spec = submodules.attentions[attention_module(config, layer_number)]
        return spec.module(config, spec.submodules, layer_number, *args, **kwargs)


@dataclasses.dataclass
class PerLayerSelfAttentionSubmodules:
    """The submodules of `PerLayerSelfAttention`.

    Args:
        attentions: attention class (as `attention_module(config, layer_number)` names it) ->
            the spec of that layer kind, without params (the outer spec's apply).
    """

    attentions: Dict[type, ModuleSpec]


def _fields(submodules) -> dict:
    return {field.name: getattr(submodules, field.name) for field in dataclasses.fields(submodules)}


def _standard_attention(attention: ModuleSpec, config) -> ModuleSpec:
    return attention


def _mea_attention(attention: ModuleSpec, config) -> ModuleSpec:
    """MEA's spec from Megatron's `SelfAttention` spec: its submodules, HLC (`head_mix`, unless
    `mea_hlc=False`) and the head norm (`head_norm`, run inside `linear_proj`)."""
    fields = _fields(attention.submodules)
    if config.mea_head_norm:
        fields["linear_proj"] = head_normed_projection(fields["linear_proj"])
    submodules = MEASelfAttentionSubmodules(
        **fields,
        head_mix=HeadMix if config.mea_hlc else None,
        head_norm=HeadRMSNorm if config.mea_head_norm else None,
    )
    return dataclasses.replace(attention, module=MEASelfAttention, submodules=submodules)


def _kha_attention(attention: ModuleSpec, config) -> ModuleSpec:
    """KHA's spec from Megatron's `SelfAttention` spec: its submodules and `knock`."""
    submodules = KHASelfAttentionSubmodules(**_fields(attention.submodules), knock=KnockingHeads)
    return dataclasses.replace(attention, module=KHASelfAttention, submodules=submodules)


def _kha_mla_attention(attention: ModuleSpec, config) -> ModuleSpec:
    """KHA's spec from Megatron's `MLASelfAttention` spec: its submodules and `knock`."""
    submodules = KHAMLASelfAttentionSubmodules(
        **_fields(attention.submodules), knock=MLAKnockingHeads
    )
    return dataclasses.replace(attention, module=KHAMLASelfAttention, submodules=submodules)


def _per_layer_attention(attention: ModuleSpec, config) -> ModuleSpec:
    """`PerLayerSelfAttention`'s spec from Megatron's `SelfAttention` spec: the spec of each
    class a layer has (MTP layers, numbered after the decoder's, take `attention_variant`)."""
    numbers = range(1, config.num_layers + 2)
    attentions = {}
    for module in sorted({attention_module(config, n) for n in numbers}, key=lambda m: m.__name__):
        spec = _ATTENTION_SPECS[module](attention, config)
        attentions[module] = ModuleSpec(module=spec.module, submodules=spec.submodules)
    submodules = PerLayerSelfAttentionSubmodules(attentions=attentions)
    return dataclasses.replace(attention, module=PerLayerSelfAttention, submodules=submodules)


# The class `attention_module` names -> its spec, built from Megatron's `SelfAttention` spec.
_ATTENTION_SPECS = {
    SelfAttention: _standard_attention,
    MEASelfAttention: _mea_attention,
    KHASelfAttention: _kha_attention,
    PerLayerSelfAttention: _per_layer_attention,
}
# ... and from Megatron's `MLASelfAttention` spec (the config admits KHA only).
_MLA_ATTENTION_SPECS = {KHASelfAttention: _kha_mla_attention}


def _swap_layer(layer_spec: ModuleSpec, config) -> ModuleSpec:
    """`layer_spec` with the self-attention of `config`'s variant (itself where it has it)."""
    module = attention_module(config)
    attention = layer_spec.submodules.self_attention
    if module is SelfAttention or attention.module in (module, _MLA_MODULES.get(module)):
        return layer_spec  # a plain config, or built for this variant already
    if attention.module is MLASelfAttention:
        if module not in _MLA_ATTENTION_SPECS:
            raise ValueError(f"{module.__name__} has no multi-latent attention counterpart")
        attention = _MLA_ATTENTION_SPECS[module](attention, config)
    elif attention.module is SelfAttention:
        attention = _ATTENTION_SPECS[module](attention, config)
    else:
        # Subclasses too (0.19's FusedMLASelfAttention fuses the down-projections with its own
        # state-dict layout): only the exact classes are known to keep their q/k/v path.
        raise ValueError(
            f"cannot apply an attention variant to {attention.module.__name__}: only Megatron's "
            "SelfAttention and MLASelfAttention are supported"
        )
    submodules = dataclasses.replace(layer_spec.submodules, self_attention=attention)
    return dataclasses.replace(layer_spec, submodules=submodules)


def apply_attention_variant(
    spec: Union[ModuleSpec, TransformerBlockSubmodules], config
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """Return `spec` (a layer spec or a block spec) with the self-attention of `config`'s variant.

    Megatron shares one spec object between all layers of a kind; the copy keeps that sharing.
    Megatron-LM's own scripts (patched) build their spec and then call this, so the MoE router
    fix for a missing TE (`compat.bind_te_general_gemm_without_te`) is applied here too.
    """
    if getattr(config, "num_moe_experts", None):
        bind_te_general_gemm_without_te()
    return _map_layers(spec, lambda layer_spec: _swap_layer(layer_spec, config))


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


def _check_core_attention(
    core_attention: str, use_transformer_engine: bool, multi_latent_attention: bool = False
) -> None:
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(
            f"core_attention must be one of {sorted(CORE_ATTENTIONS)}, got {core_attention!r}"
        )
    if use_transformer_engine and core_attention != "megatron":
        raise ValueError(
            f"core_attention={core_attention!r} applies to the local spec only "
            "(use_transformer_engine=False); the TE spec uses TEDotProductAttention"
        )
    if multi_latent_attention and not use_transformer_engine and core_attention == "megatron":
        raise ValueError(
            "multi_latent_attention on the local spec needs core_attention='sdpa': Megatron's "
            "local DotProductAttention does not take MLA's separate q/k and v head sizes"
        )


def _swap_core_attention_of_layer(layer_spec: ModuleSpec, module: type) -> ModuleSpec:
    attention = layer_spec.submodules.self_attention
    if attention.module in (MLASelfAttention, KHAMLASelfAttention):
        module = _MLA_CORE_ATTENTIONS.get(module, module)
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


def _duplicate_mla_down_projections(layer_spec: ModuleSpec) -> ModuleSpec:
    attention = layer_spec.submodules.self_attention
    if attention.module not in (MLASelfAttention, KHAMLASelfAttention):
        return layer_spec
    down = {
        name: DuplicatedLinear
        for name in ("linear_q_down_proj", "linear_kv_down_proj")
        if getattr(attention.submodules, name) is ColumnParallelLinear
    }
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, **down)
    )
    submodules = dataclasses.replace(layer_spec.submodules, self_attention=attention)
    return dataclasses.replace(layer_spec, submodules=submodules)


def apply_local_mla_down_projections(
    spec: Union[ModuleSpec, TransformerBlockSubmodules],
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """Return `spec` (a local layer or block spec) with MLA's down-projections duplicated on
    every TP rank, as the TE spec has them (TELinear, "duplicated").

    Megatron's local MLA spec shards them as ColumnParallelLinear and all-gathers their output;
    that gather's backward keeps each rank's slice of the gradient, so the shared RoPE key's
    gradient, which every rank computes for its own heads only, is never summed over TP (wrong
    `linear_kv_down_proj` and input gradients at TP > 1). Duplicated, the key is all-gathered
    over the sequence (SP) and that gather's backward sums it. Their weights are initialised by
    torch's `nn.Linear` default rather than `config.init_method`.
    """
    return _map_layers(spec, _duplicate_mla_down_projections)


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
            or `"sdpa"` (torch's `scaled_dot_product_attention`, same function). MLA needs
            `"sdpa"` here.
    """
    _check_core_attention(core_attention, use_transformer_engine, config.multi_latent_attention)
    # Megatron's builders take None for "dense"; here None means "as the config says".
    num_experts = config.num_moe_experts if num_experts is None else (num_experts or None)
    moe_grouped_gemm = config.moe_grouped_gemm if moe_grouped_gemm is None else moe_grouped_gemm
    qk_layernorm = config.qk_layernorm if qk_layernorm is None else qk_layernorm
    if num_experts:
        bind_te_general_gemm_without_te()
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
        spec = apply_local_mla_down_projections(spec)
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
    (local backend) the core attention `core_attention` (`"megatron"` or `"sdpa"`; MLA needs
    `"sdpa"`)."""
    _check_core_attention(core_attention, use_transformer_engine, config.multi_latent_attention)
    if use_transformer_engine:
        require("transformer_engine", "use_transformer_engine=True")
    if config.num_moe_experts:
        bind_te_general_gemm_without_te()
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
        spec = apply_local_mla_down_projections(spec)
    return apply_attention_variant(spec, config)
