"""Parameter counts, training FLOPs and KV-cache size of a GPT config, baseline / MEA / KHA.

Pure arithmetic on a `ModelShape`; `mea-model-size` is the command line over it. Notation:
`L` layers, `h` hidden, `np` query heads, `ng` KV groups, `nc` MEA component heads, `hn` head dim,
`E` routed experts, `k` top-k, `f` dense FFN width, `fe` expert width, `V` padded vocab, `s` sequence.

What is counted (Megatron-Core's GPTModel, the parameters a checkpoint holds):
- embedding `V*h` (+ `max_position_embeddings*h` for learned absolute positions, Megatron-LM's
  default; RoPE has no parameters); output layer `V*h` unless tied;
- per layer: input norm, `linear_qkv` `h*(np + 2*nkv)*hn` with `nkv = nc` for MEA (the projection
  produces component heads) and `ng` otherwise, `linear_proj` `np*hn*h`, q/k norms `2*hn`,
  MEA `head_mix` `2*nc*ng` and `head_norm` `np*hn`, KHA `hn^2` per target (`linear`, `gate`) or
  `3*hn^2` (`mlp`), pre-MLP norm, then a dense MLP `(2 if swiglu else 1)*h*f + f*h` or, on MoE layers, a
  router `h*E` (+ `E` biases), `E` experts of `(2|1)*h*fe + fe*h` and the shared expert if any;
- a final norm `h`. Biases where `add_bias_linear` / `add_qkv_bias`; LayerNorm counts weight+bias.
MTP layers are not counted. Active parameters count `k` of the `E` routed experts per MoE layer.

Training FLOPs per token follow Megatron-LM's `num_floating_point_operations` convention:
`3 * (forward)` where forward is `2 * (active matmul parameters)` (input embedding and norms
excluded, output layer and router included) plus causal attention `2 * 2 * np * hn * s / 2` per
layer, plus the variants' own small matmuls (HLC `2 * 2*nc*ng*hn`, KHA `2*hn^2` per head, target
and matrix). `layer_forward_flops` gives one layer's forward terms; with `causal=False` they are
the KHA paper's Section 3.4 terms per token (its eqs. 10-12 count the full `s x s` scores).
KV-cache bytes per token: `2 (K and V) * L * nkv * hn * bytes_per_element`; MEA with virtual heads
caches only the `nc` components, plus (with an RMS k norm) one inverse RMS per composite key
(`ng` scalars per token and layer, in the cache dtype); with a LayerNorm k norm the composites
(`kv_cache_elements`, as `layers/kv_cache.py` lays the cache out).
"""

import dataclasses
import typing
from typing import Union

from megatron_mea.model.args import ModelArgs, derived_sizes, moe_layers
from megatron_mea.variant import KHA_MATRICES


@dataclasses.dataclass
class ModelShape(ModelArgs):
    """The sizes that determine parameters and FLOPs: the fields of the model description
    (`megatron_mea.model.args.ModelArgs`, its defaults included), `vocab_size` required."""

    def __post_init__(self):
        if self.vocab_size is None:
            raise ValueError("ModelShape: vocab_size is required (the padded vocabulary)")
        sizes = derived_sizes(self)
        self.num_query_groups = sizes["num_query_groups"]
        self.kv_channels = sizes["kv_channels"]
        self.ffn_hidden_size = sizes["ffn_hidden_size"]
        if self.num_experts:
            self.moe_ffn_hidden_size = sizes["moe_ffn_hidden_size"]
        self.resolve_variant_defaults(self.num_query_groups, moe=bool(self.num_experts))

    @classmethod
    def from_args(cls, args) -> "ModelShape":
        """From a Megatron-LM-style args namespace (plus the plugin flags, if present).

        Uses `padded_vocab_size` when set, else `vocab_size`; `num_query_groups` only with
        `group_query_attention`, as Megatron-LM does.
        """
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            optional = type(None) in typing.get_args(f.type)
            if value is not None or (hasattr(args, f.name) and optional):
                kwargs[f.name] = value
        kwargs["vocab_size"] = getattr(args, "padded_vocab_size", None) or args.vocab_size
        if not getattr(args, "group_query_attention", True):
            kwargs.pop("num_query_groups", None)
        return cls(**kwargs)

    def kv_heads(self, layer: int) -> int:
        """K/V heads `linear_qkv` of 0-based `layer` produces and the cache holds: `nc` for MEA,
        else `ng`."""
        if self.variant_of(layer + 1) != "mea":
            return self.num_query_groups
        per_layer = self.mea_num_kv_components_per_layer
        return per_layer[layer] if per_layer else self.mea_num_kv_components

    @property
    def kv_heads_stored(self) -> Union[int, tuple]:
        """`kv_heads` of every layer: one number when all layers agree, else one per layer."""
        heads = tuple(self.kv_heads(layer) for layer in range(self.num_layers))
        return heads[0] if len(set(heads)) == 1 else heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based `layer` is an MoE layer (`megatron_mea.model.args.moe_layers`)."""
        return moe_layers(self)[layer]

def _norm(shape: ModelShape, width: int) -> int:
    return width if shape.normalization == "RMSNorm" else 2 * width


def _mlp(shape: ModelShape, width: int) -> int:
    gated = 2 if shape.swiglu else 1
    bias = (gated * width + shape.hidden_size) if shape.add_bias_linear else 0
    return gated * shape.hidden_size * width + width * shape.hidden_size + bias


def attention_params(shape: ModelShape, layer: int = 0) -> dict:
    """Attention parameters of 0-based `layer`, split into `matmul` (q/k/v/o) and the variant's
    `extra`."""
    h, np_, hn, ng, nkv = (shape.hidden_size, shape.num_attention_heads, shape.kv_channels,
                           shape.num_query_groups, shape.kv_heads(layer))
    variant = shape.variant_of(layer + 1)
    qkv_out = (np_ + 2 * nkv) * hn
    matmul = h * qkv_out + np_ * hn * h
    extra = _norm(shape, h)  # input layernorm (fused into linear_qkv with TE)
    if shape.add_bias_linear or shape.add_qkv_bias:
        extra += qkv_out
    if shape.add_bias_linear:
        extra += h
    if shape.qk_layernorm:
        extra += 2 * _norm(shape, hn)
    if variant == "mea":
        extra += (2 * nkv * ng if shape.mea_hlc else 0) + (np_ * hn if shape.mea_head_norm else 0)
    elif variant == "kha":
        extra += len(KHA_MATRICES[shape.kha_variant]) * len(shape.kha_targets) * hn * hn
    return {"matmul": matmul, "extra": extra}


def variant_forward_flops(shape: ModelShape, layer: int = 0) -> int:
    """Forward FLOPs per token of 0-based `layer`'s variant ops (HLC or KHA matmuls)."""
    hn, np_, ng = shape.kv_channels, shape.num_attention_heads, shape.num_query_groups
    variant = shape.variant_of(layer + 1)
    if variant == "mea":
        return 2 * 2 * shape.kv_heads(layer) * ng * hn if shape.mea_hlc else 0
    if variant == "kha":
        heads = {"q": np_, "k": ng, "v": ng}
        matrices = len(KHA_MATRICES[shape.kha_variant])
        return sum(matrices * 2 * hn * hn * heads[t] for t in shape.kha_targets)
    return 0


def layer_forward_flops(shape: ModelShape, layer: int = 0, causal: bool = True) -> dict:
    """Forward FLOPs per token of 0-based `layer`, 2 per multiply-add, by term.

    Args:
        shape: the model.
        layer: the layer.
        causal: count half of the `s x s` attention scores (Megatron-LM's convention) or all of
            them (the KHA paper's eq. 10). Default: True.

    Returns:
        dict with `projections` (q/k/v/o matmuls), `attention` (scores and scores times V over
        the sequence), `mlp` (the dense MLP, or router, shared expert and `k` routed experts)
        and `variant` (`variant_forward_flops`).
    """
    h = shape.hidden_size
    if shape.is_moe_layer(layer):
        shared = (_mlp(shape, shape.moe_shared_expert_intermediate_size)
                  if shape.moe_shared_expert_intermediate_size else 0)
        mlp = (h * shape.num_experts + shared
               + shape.moe_router_topk * _mlp(shape, shape.moe_ffn_hidden_size))
    else:
        mlp = _mlp(shape, shape.ffn_hidden_size)
    scores = 2 * 2 * shape.num_attention_heads * shape.kv_channels * shape.seq_length
    return {
        "projections": 2 * attention_params(shape, layer)["matmul"],
        "attention": scores // 2 if causal else scores,
        "mlp": 2 * mlp,
        "variant": variant_forward_flops(shape, layer),
    }


def kv_cache_elements(shape: ModelShape, layer: int = 0) -> int:
    """Cache elements per token of 0-based `layer`: K and V of the heads the cache holds, plus
    the key scales of MEA's component cache (the layout of `layers/kv_cache.py`).

    MEA with `nc < ng` caches the `nc` components; with a k norm (`qk_layernorm`) it also keeps
    the inverse RMS of each of the `ng` composite keys, and a LayerNorm k norm (whose mean and
    bias do not factor out of the mix) makes it cache the `ng` composites instead. Every other
    layer caches its `ng` K/V heads."""
    hn, ng, nkv = shape.kv_channels, shape.num_query_groups, shape.kv_heads(layer)
    if shape.variant_of(layer + 1) != "mea" or nkv == ng:
        return 2 * ng * hn
    if not shape.qk_layernorm:
        return 2 * nkv * hn
    if shape.normalization != "RMSNorm":
        return 2 * ng * hn
    return 2 * nkv * hn + ng


def model_size(shape: ModelShape, bytes_per_element: int = 2) -> dict:
    """Total and active parameters, training FLOPs per token and KV-cache bytes per token.

    Args:
        shape: the model.
        bytes_per_element: KV-cache element size (2 for bf16, 1 for fp8). Default: 2.

    Returns:
        dict with `total_params`, `active_params`, `embedding_params` (of which
        `position_embedding_params`: learned absolute positions, Megatron-LM's default
        `--position-embedding-type`), `expert_params`, `training_flops_per_token`,
        `kv_cache_bytes_per_token`, `kv_heads_stored`.
    """
    h, V = shape.hidden_size, shape.vocab_size
    positions = 0
    if shape.position_embedding_type == "learned_absolute":
        positions = derived_sizes(shape)["max_position_embeddings"] * h
    embedding = V * h + positions
    output = V * h if shape.untie_embeddings_and_output_weights else 0
    total = active = embedding + output + _norm(shape, h)
    # A tied output layer still multiplies.
    forward = 2 * (output if output else V * h)
    experts_total = 0
    for layer in range(shape.num_layers):
        attn = attention_params(shape, layer)
        forward += sum(layer_forward_flops(shape, layer).values())
        layer_params = attn["matmul"] + attn["extra"] + _norm(shape, h)
        if shape.is_moe_layer(layer):
            expert = _mlp(shape, shape.moe_ffn_hidden_size)
            shared = (_mlp(shape, shape.moe_shared_expert_intermediate_size)
                      if shape.moe_shared_expert_intermediate_size else 0)
            # Megatron's router has a bias per expert when the linears have biases.
            router = (h + (1 if shape.add_bias_linear else 0)) * shape.num_experts
            experts_total += shape.num_experts * expert
            total += layer_params + router + shared + shape.num_experts * expert
            active += layer_params + router + shared + shape.moe_router_topk * expert
        else:
            mlp = _mlp(shape, shape.ffn_hidden_size)
            total += layer_params + mlp
            active += layer_params + mlp
    return {
        "total_params": total,
        "active_params": active,
        "embedding_params": embedding + output,
        "position_embedding_params": positions,
        "expert_params": experts_total,
        "training_flops_per_token": int(3 * forward),
        "kv_cache_bytes_per_token": bytes_per_element * sum(
            kv_cache_elements(shape, layer) for layer in range(shape.num_layers)
        ),
        "kv_heads_stored": shape.kv_heads_stored,
    }
