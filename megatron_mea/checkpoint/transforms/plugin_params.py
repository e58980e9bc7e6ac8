"""The plugin's parameters in conversions: their upcycling init, and folding them away.

Upcycling (import of a plain model into a variant) gives every plugin parameter the value at
which the variant computes the plain model: identity mixing (`nc == ng`), head-norm scale 1
(the norm itself still changes the function; it is optional for that reason), KHA identity
transforms and a zero KHA-MLP gate.

Folding (export to a stock architecture) works on one layer's TP=1 tensors: HLC without the
head norm and KHA-Linear are linear maps right after the projection, so they fold into the
`linear_qkv` rows (docs/math.md). Folding runs in fp32 and casts back.
"""

import re
from typing import Dict

import torch

from megatron_mea.checkpoint.transforms.fold import fold_head_mix, fold_kha_linear
from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv

_PLUGIN = re.compile(r"\.self_attention\.(head_mix|head_norm|knock)\.")


def is_plugin_param(name: str) -> bool:
    """Whether a state-dict name is one of the plugin's parameters."""
    return bool(_PLUGIN.search(name))


def upcycle_init(name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The value of plugin parameter `name` at which the variant computes the plain model."""
    leaf = name.rsplit(".", 2)[-2:]
    if leaf[0] == "head_norm":
        return torch.ones(shape, dtype=dtype)
    if leaf[0] == "knock" and leaf[1].endswith("_gate"):
        return torch.zeros(shape, dtype=dtype)
    if leaf[0] in ("head_mix", "knock"):
        if shape[0] != shape[1]:
            raise ValueError(f"{name}: upcycling needs a square identity init, shape {list(shape)}")
        return torch.eye(shape[0], dtype=dtype)
    raise ValueError(f"{name}: not a plugin parameter")


def foldable(config) -> bool:
    """Whether the variant of `config` folds into a plain attention (no head norm, no k norm
    before the mix, no KHA-MLP)."""
    variant = config.attention_variant
    if variant == "mea":
        # A k norm between the projection and the mix does not fold into the K rows.
        before_mix = config.mea_key_norm_before_mix and config.qk_layernorm
        return not config.mea_head_norm and not before_mix
    if variant == "kha":
        return config.kha_variant == "linear"
    return True


def fold_layer(tensors: Dict[str, torch.Tensor], layer: int, config) -> Dict[str, torch.Tensor]:
    """One layer's tensors with MEA (no head norm) or KHA-Linear folded into `linear_qkv`.

    Args:
        tensors: state-dict name -> tensor of layer `layer` (TP=1).
        config: the model's `MEATransformerConfig`.

    Returns:
        The tensors of the same layer of the plain model (`nc` -> `ng` K/V heads for MEA).
    """
    variant = config.variant_of(layer + 1)
    if variant == "standard":
        return tensors
    if not foldable(config):
        raise ValueError(
            f"attention_variant={config.attention_variant!r} (mea_head_norm="
            f"{config.mea_head_norm}, mea_key_norm_before_mix={config.mea_key_norm_before_mix}, "
            f"kha_variant={config.kha_variant!r}) does not fold into "
            "plain attention"
        )
    prefix = f"decoder.layers.{layer}.self_attention."
    out = {k: v for k, v in tensors.items() if not is_plugin_param(k)}
    np_, hn = config.num_attention_heads, config.kv_channels
    if variant == "mea":
        groups = config.kv_components(layer + 1)
        mix = {k: tensors[f"{prefix}head_mix.{k}_weight"].float() for k in ("key", "value")}

        def fold(q, k, v):
            return q, fold_head_mix(k, mix["key"]), fold_head_mix(v, mix["value"])

    else:
        groups = config.num_query_groups
        transforms = {t: tensors[f"{prefix}knock.{t}_weight"].float() for t in config.kha_targets}

        def fold(q, k, v):
            heads = dict(q=q, k=k, v=v)
            for target, transform in transforms.items():
                heads[target] = fold_kha_linear(heads[target], transform)
            return heads["q"], heads["k"], heads["v"]

    for suffix in ("weight", "bias"):
        name = f"{prefix}linear_qkv.{suffix}"
        if name in tensors:
            fused = tensors[name]
            q, k, v = unfuse_qkv(fused.float(), np_, groups, hn)
            out[name] = fuse_qkv(*fold(q, k, v)).to(fused.dtype)
    return out
