"""MEA post-hoc KV compression (docs/math.md; the MEA paper's App. F).

For K and V of one layer, separately: stack the projection rows of each composite KV head into
one column (`hn*h` weight entries, plus `hn` bias entries when there are biases), so
`M = [(hn*h) x ng]`; take `M = U S Vt` and keep the top `nc`: the component heads are the columns
of `U[:, :nc]` and `A = diag(S[:nc]) @ Vt[:nc, :]` (`[nc, ng]`), so `components @ A` is the
Frobenius-optimal rank-`nc` approximation of `M`, and exactly `M` when `nc == ng`. The model
becomes MEA with `mea_num_kv_components = nc`: the K/V projection rows and the KV cache shrink
to `nc/ng`. Query heads are regrouped under the `nc` component groups of `linear_qkv`.

A baseline checkpoint gives an MEA model without the head norm (a pure reparametrisation) unless
asked otherwise; an MEA checkpoint keeps its head norm (it acts after attention, so the
compression is exact at `nc == ng` either way) and its mixing is folded in before the SVD.

`probe_layers` compresses each layer alone (in memory, same SVD) and measures the loss increase
on given tokens; its ranking is what a layer selection is chosen from.
"""

import dataclasses
import logging
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint, write_checkpoint
from megatron_mea.checkpoint.transforms.fold import fold_head_mix
from megatron_mea.checkpoint.torch_dist.model_only import (
    ConversionError,
    SINGLE_PROCESS_LAYOUT,
    ModelDescription,
    build_stage_model,
    converter_process,
    load_model_weights,
)
from megatron_mea.checkpoint.torch_dist.output_dir import check_new_directory
from megatron_mea.checkpoint.transforms.plugin_params import upcycle_init
from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv

logger = logging.getLogger(__name__)

_ALL_BUT_FIRST = re.compile(r"^all-but-first-(\d+)$")


def select_layers(selection: str, num_layers: int) -> List[int]:
    """Layer indices (0-based, as Hugging Face numbers `model.layers.N`) named by `selection`.

    Args:
        selection: `all`, `paper-half`, `middle-half`, `all-but-first-N`, or a comma-separated
            list of indices and ranges (`0,3,5-7`). The MEA paper's settings on its 48-layer
            model are `all`, `paper-half` (layers 11-34) and `all-but-first-3`; `paper-half`
            keeps that window for other depths: the L/2 layers from L/4 - 1. `middle-half` is
            the centred window, L/4 to 3L/4 - 1 (12-35 of 48).
        num_layers: L.
    """
    text = selection.strip()
    if text == "all":
        return list(range(num_layers))
    if text == "middle-half":
        return list(range(num_layers // 4, num_layers - num_layers // 4))
    if text == "paper-half":
        start = max(num_layers // 4 - 1, 0)
        return list(range(start, start + num_layers // 2))
    match = _ALL_BUT_FIRST.match(text)
    if match:
        return list(range(min(int(match.group(1)), num_layers), num_layers))
    layers = set()
    for item in text.split(","):
        bounds = item.strip().split("-")
        if not all(b.strip().isdigit() for b in bounds) or len(bounds) > 2:
            raise ValueError(
                f"layer selection ({selection!r}) must be 'all', 'paper-half', 'middle-half', "
                "'all-but-first-N' or a list such as '0,3,5-7'"
            )
        first, last = int(bounds[0]), int(bounds[-1])
        layers.update(range(first, last + 1))
    bad = [layer for layer in layers if layer >= num_layers]
    if bad:
        raise ValueError(f"layer selection ({selection!r}) names layer {bad[0]}; the model has "
                         f"{num_layers} layers (0-based)")
    return sorted(layers)


def svd_heads(heads: torch.Tensor, num_components: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank-`nc` factorisation over heads: `heads[h] ~= sum_j components[j] * mix[j, h]`.

    Args:
        heads: `[ng, ...]` (one K or V head per row, any trailing shape).
        num_components: nc (<= ng).

    Returns:
        components `[nc, ...]` (orthonormal when flattened), mix `[nc, ng]`; fp32.
    """
    num_heads = heads.shape[0]
    if not 1 <= num_components <= num_heads:
        raise ValueError(f"num_components ({num_components}) must be in [1, {num_heads}]")
    matrix = heads.reshape(num_heads, -1).T.double()  # [D, ng], one column per head
    u, s, vt = torch.linalg.svd(matrix, full_matrices=False)
    components = u[:, :num_components].T.reshape(num_components, *heads.shape[1:])
    mix = torch.diag(s[:num_components]) @ vt[:num_components]
    return components.float(), mix.float()


def _composite_kv(tensors, layer, config) -> Tuple[Dict, int]:
    """`{"weight"|"bias": (q, k, v)}` with composite (ng) K/V heads, fp32; and nc of the input."""
    variant = config.variant_of(layer + 1)  # a source compressed before mixes variants
    if variant == "kha":
        raise ConversionError("KV compression applies to baseline or MEA checkpoints, not KHA")
    prefix = f"decoder.layers.{layer}.self_attention."
    groups = config.kv_components(layer + 1) if variant == "mea" else config.num_query_groups
    out = {}
    for suffix in ("weight", "bias"):
        name = f"{prefix}linear_qkv.{suffix}"
        if name not in tensors:
            continue
        q, k, v = unfuse_qkv(tensors[name].float(), config.num_attention_heads, groups,
                             config.kv_channels)
        if variant == "mea":
            k = fold_head_mix(k, tensors[prefix + "head_mix.key_weight"].float())
            v = fold_head_mix(v, tensors[prefix + "head_mix.value_weight"].float())
        out[suffix] = (q, k, v)
    return out, groups


def _factorise(parts: Dict, num_components: int):
    """SVD of K and V over the stacked weight (and bias) rows of each head."""
    result = {}
    for index, kind in ((1, "key"), (2, "value")):
        weight = parts["weight"][index]  # [ng, hn, h]
        stacked = weight
        if "bias" in parts:
            stacked = torch.cat([weight, parts["bias"][index].unsqueeze(-1)], dim=-1)
        components, mix = svd_heads(stacked, num_components)
        if "bias" in parts:
            result[kind] = (components[..., :-1], components[..., -1], mix)
        else:
            result[kind] = (components, None, mix)
    return result


def compress_layer(tensors: Dict, layer: int, config, num_components: int) -> Dict:
    """One layer's tensors as MEA with `nc` component K/V heads (SVD of the composite K/V).

    Args:
        tensors: the layer's TP=1 tensors of a baseline or MEA model with `config`.
        num_components: nc.

    Returns:
        The layer's tensors for `mea_num_kv_components = nc` (`linear_qkv` with nc groups and
        new `head_mix` matrices); the head norm, if any, is kept.
    """
    prefix = f"decoder.layers.{layer}.self_attention."
    parts, _ = _composite_kv(tensors, layer, config)
    factors = _factorise(parts, num_components)
    out = dict(tensors)
    dtype = tensors[prefix + "linear_qkv.weight"].dtype
    for suffix, position in (("weight", 0), ("bias", 1)):
        if suffix in parts:
            q = parts[suffix][0]
            k, v = factors["key"][position], factors["value"][position]
            out[f"{prefix}linear_qkv.{suffix}"] = fuse_qkv(q, k, v).to(dtype)
    out[prefix + "head_mix.key_weight"] = factors["key"][2].to(dtype)
    out[prefix + "head_mix.value_weight"] = factors["value"][2].to(dtype)
    return out


def approximate_layer(tensors: Dict, layer: int, config, num_components: int) -> Dict:
    """The layer compressed to `nc` components, expressed in the input model's own layout (same
    shapes): the function `compress_layer` gives, for a probe on the unchanged model."""
    prefix = f"decoder.layers.{layer}.self_attention."
    parts, groups = _composite_kv(tensors, layer, config)
    factors = _factorise(parts, num_components)
    out = dict(tensors)
    dtype = tensors[prefix + "linear_qkv.weight"].dtype
    mea = config.variant_of(layer + 1) == "mea"
    for suffix, position in (("weight", 0), ("bias", 1)):
        if suffix not in parts:
            continue
        kv = []
        for kind in ("key", "value"):
            comp, mix = factors[kind][position], factors[kind][2]
            if mea:
                # Pad to the model's component count with zero components.
                pad = comp.new_zeros(groups - num_components, *comp.shape[1:])
                kv.append(torch.cat([comp, pad]))
            else:
                kv.append(fold_head_mix(comp, mix))
        out[f"{prefix}linear_qkv.{suffix}"] = fuse_qkv(parts[suffix][0], *kv).to(dtype)
    if mea:
        for kind in ("key", "value"):
            mix = factors[kind][2]
            pad = mix.new_zeros(groups - num_components, mix.shape[1])
            out[f"{prefix}head_mix.{kind}_weight"] = torch.cat([mix, pad]).to(dtype)
    return out


def kv_heads_per_layer(config) -> List[int]:
    """The K/V heads each layer of `config` computes and caches, 0-based: MEA's `nc`, the
    query groups of a standard layer."""
    return [config.kv_components(layer + 1) if config.variant_of(layer + 1) == "mea"
            else config.num_query_groups for layer in range(config.num_layers)]


def compressed_description(
    description: ModelDescription,
    num_components: int,
    mea_head_norm: Optional[bool] = None,
    layers: Optional[Sequence[int]] = None,
    mea_key_norm_before_mix: bool = False,
) -> ModelDescription:
    """The description of the compressed model: MEA with `nc` components in `layers` (default
    all); the others stay standard attention (a baseline source) or MEA with `nc = ng` (an MEA
    source, an exact reparametrisation). `mea_key_norm_before_mix` makes it norm-then-mix."""
    config = description.config
    if config.attention_variant == "kha":
        raise ConversionError("KV compression applies to baseline or MEA checkpoints, not KHA")
    if config.mea_key_norm_before_mix:
        # Its composite keys mix normed components: not linear in the K rows the SVD factors.
        raise ConversionError("KV compression of a norm-then-mix MEA checkpoint "
                              "(mea_key_norm_before_mix) is not supported")
    if mea_key_norm_before_mix and not config.qk_layernorm:
        raise ConversionError("mea_key_norm_before_mix needs a k norm (qk_layernorm): the "
                              "checkpoint has none")
    ng, num_layers = config.num_query_groups, config.num_layers
    if not 1 <= num_components <= ng:
        raise ConversionError(
            f"num_kv_components ({num_components}) must be between 1 and the checkpoint's "
            f"{ng} K/V heads"
        )
    source = kv_heads_per_layer(config)
    chosen = range(num_layers) if layers is None else layers
    grown = [layer for layer in chosen if num_components > source[layer]]
    if grown:
        # The SVD of a rank-r composite has r nonzero components: the rest would be zeros that
        # only enlarge the cache.
        raise ConversionError(
            f"num_kv_components ({num_components}) exceeds the {source[grown[0]]} K/V "
            f"components layer {grown[0]} has: compression cannot add components"
        )
    per_layer = variants = None
    if layers is not None and sorted(layers) != list(range(num_layers)):
        per_layer = [num_components if layer in set(layers) else source[layer]
                     for layer in range(num_layers)]
        # As in the paper: the layers left alone keep their variant (a baseline's stay
        # standard attention: no mixing matrices, no head norm), not MEA with nc = ng.
        chosen = set(layers)
        kept = ["mea" if layer in chosen else config.variant_of(layer + 1)
                for layer in range(num_layers)]
        variants = None if set(kept) == {"mea"} else kept
    elif config.attention_variant_per_layer is not None:
        variants = list(config.attention_variant_per_layer)
    if config.attention_variant == "mea":
        head_norm = config.mea_head_norm if mea_head_norm is None else mea_head_norm
    else:
        head_norm = bool(mea_head_norm)
    args = dataclasses.replace(
        description.args,
        attention_variant="mea",
        attention_variant_per_layer=variants,
        mea_num_kv_components=num_components if per_layer is None else None,
        mea_num_kv_components_per_layer=per_layer,
        mea_mix_init=None,
        mea_head_norm=head_norm,
        mea_key_norm_before_mix=mea_key_norm_before_mix,
        kha_variant=None,
        kha_targets=None,
    )
    out = dataclasses.replace(description, args=args)
    out.run_config()  # validates nc against the heads and the recorded TP size
    return out


def compress_checkpoint(
    load_dir: str,
    save_dir: str,
    num_kv_components: int,
    *,
    layers: str = "all",
    mea_head_norm: Optional[bool] = None,
    mea_key_norm_before_mix: bool = False,
    iteration: Optional[int] = None,
) -> ModelDescription:
    """Write an MEA checkpoint with `nc` component K/V heads from a baseline / MEA checkpoint.

    Args:
        load_dir: checkpoint root (saved at any TP / PP / EP).
        save_dir: output root, new or empty: a model-only checkpoint `mea-pretrain --load`
            continues from.
        num_kv_components: nc.
        layers: layer selection (`select_layers`). The other layers of a baseline checkpoint stay
            standard attention (`attention_variant_per_layer`); those of an MEA checkpoint stay
            MEA with `nc = ng` (an exact SVD reparametrisation). The counts are recorded in
            `mea_num_kv_components_per_layer`.
        mea_head_norm: add (True) or drop (False) the head norm. Default: keep the checkpoint's
            (a baseline has none; adding one changes the function).
        mea_key_norm_before_mix: norm-then-mix (the k norm on each component key, then the
            mix): the same weights, a different function from the source's mix-then-norm (not
            exact even at `nc == ng`), whose cache is the components alone. Default: False.
        iteration: checkpoint to read. Default: the latest.

    Returns:
        The description of the written model.

    Raises:
        ConversionError: `save_dir` is not new or empty (checked first), or `nc` / `layers` do
            not fit the model. Nothing is left under `save_dir` then.
    """
    check_new_directory(save_dir)
    description = ModelDescription.load(load_dir)
    num_layers = description.args.num_layers
    selected = select_layers(layers, num_layers)
    source_config = description.config
    target = compressed_description(description, num_kv_components, mea_head_norm, selected,
                                    mea_key_norm_before_mix)
    target_config = target.config
    with converter_process():
        _, groups = read_checkpoint(load_dir, description, iteration)

        def produce():
            for layer, tensors in groups:
                if layer >= 0 and target_config.variant_of(layer + 1) == "mea":
                    tensors = compress_layer(
                        tensors, layer, source_config, target_config.kv_components(layer + 1)
                    )
                    prefix = f"decoder.layers.{layer}.self_attention."
                    norm = prefix + "head_norm.weight"
                    if target_config.mea_head_norm and norm not in tensors:
                        shape = (target_config.num_attention_heads * target_config.kv_channels,)
                        dtype = tensors[prefix + "linear_qkv.weight"].dtype
                        tensors[norm] = upcycle_init(norm, shape, dtype)
                    if not target_config.mea_head_norm:
                        tensors.pop(norm, None)
                    logger.info("compressed layer %d", layer)
                yield tensors

        write_checkpoint(save_dir, target, produce())
    return target


@dataclasses.dataclass
class ProbeResult:
    """Loss of the unchanged model and of each layer compressed alone."""

    baseline_loss: float
    layer_losses: Dict[int, float]

    def ranking(self) -> List[Tuple[int, float]]:
        """(layer, loss increase), cheapest layer to compress first."""
        increases = {
            layer: loss - self.baseline_loss for layer, loss in self.layer_losses.items()
        }
        return sorted(increases.items(), key=lambda item: item[1])

    def table(self) -> str:
        """The ranking as text."""
        lines = [f"baseline loss {self.baseline_loss:.6f}", "rank  layer  loss        increase"]
        for rank, (layer, increase) in enumerate(self.ranking(), start=1):
            lines.append(f"{rank:4d}  {layer:5d}  {self.layer_losses[layer]:.6f}  {increase:+.6f}")
        return "\n".join(lines)


def _mean_loss(model, tokens: torch.Tensor, micro_batch_size: int) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, tokens.shape[0], micro_batch_size):
            batch = tokens[start : start + micro_batch_size]
            inputs, labels = batch[:, :-1], batch[:, 1:]
            positions = torch.arange(inputs.shape[1]).expand_as(inputs)
            losses = model(inputs, positions, attention_mask=None, labels=labels)
            total += float(losses.double().sum())
            count += losses.numel()
    return total / count


def probe_layers(
    load_dir: str,
    tokens: torch.Tensor,
    num_kv_components: int,
    *,
    layers: Optional[Sequence[int]] = None,
    micro_batch_size: int = 4,
    iteration: Optional[int] = None,
) -> ProbeResult:
    """Loss increase of compressing each layer alone to `nc` K/V components.

    Runs the model at TP=1 in this process (it must fit in memory).

    Args:
        load_dir: checkpoint root (baseline or MEA).
        tokens: `[n, s + 1]` token ids (inputs and next-token labels).
        num_kv_components: nc.
        layers: layers to probe. Default: all.
        micro_batch_size: sequences per forward pass.
    """
    description = ModelDescription.load(load_dir)
    compressed_description(description, num_kv_components)  # validates nc
    layers = list(range(description.args.num_layers)) if layers is None else list(layers)
    with converter_process():
        model = build_stage_model(description, **SINGLE_PROCESS_LAYOUT).eval()
        load_model_weights(model, load_dir, iteration)
        config = model.config
        params = dict(model.named_parameters())
        baseline = _mean_loss(model, tokens, micro_batch_size)
        logger.info("probe: baseline loss %.6f", baseline)
        losses = {}
        for layer in layers:
            prefix = f"decoder.layers.{layer}.self_attention."
            names = [n for n in params if n.startswith(prefix)]
            original = {n: params[n].detach().clone() for n in names}
            approx = approximate_layer(original, layer, config, num_kv_components)
            with torch.no_grad():
                for name in names:
                    params[name].copy_(approx[name])
                losses[layer] = _mean_loss(model, tokens, micro_batch_size)
                for name in names:
                    params[name].copy_(original[name])
            logger.info("probe: layer %d loss %.6f (%+.6f)", layer, losses[layer],
                        losses[layer] - baseline)
    return ProbeResult(baseline, losses)
