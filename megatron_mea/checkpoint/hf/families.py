"""Hugging Face model families as declarative key maps onto Megatron's GPTModel state dict.

A family is a table of `Rule`s. A rule names one Megatron tensor (the names of
`GPTModel.state_dict()` with the local spec at TP=1), the Hugging Face tensors it is made of, and
the transform between the two (both directions). `{L}` is the layer and `{E}` the expert
placeholder; layer rules are relative to `decoder.layers.{L}.` / `model.layers.{L}.`.

Megatron layouts the transforms handle:
- `linear_qkv` (weight and bias) interleaves per K/V group `q_1 .. q_{np/ng} k v` (`fuse_qkv`);
- SwiGLU `linear_fc1` stacks `[gate; up]` (Megatron's `glu` activates the first half);
- the vocabulary is padded to `padded_vocab` rows with zeros (stripped on export).

Shape legend: `np` query heads, `nk` K/V heads of the `linear_qkv` layout (`ng`, or MEA's `nc`),
`hn` head dim, `h` hidden size.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv


@dataclass(frozen=True)
class Layout:
    """Sizes the transforms need.

    Attributes:
        num_heads: np. num_kv_heads: K/V heads in the fused `linear_qkv` (nc for MEA).
        head_dim: hn. vocab_size: the HF vocabulary; padded_vocab_size: Megatron's rows.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


class Transform:
    """Identity map between one Megatron tensor and one HF tensor (base of the transforms)."""

    def to_megatron(self, layout: Layout, *hf: torch.Tensor) -> torch.Tensor:
        """Megatron tensor from the rule's HF tensors (in the rule's order)."""
        (tensor,) = hf
        return tensor

    def to_hf(self, layout: Layout, tensor: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The rule's HF tensors from the Megatron tensor."""
        return (tensor,)


class Vocab(Transform):
    """Embedding / output rows: zero-pad to Megatron's padded vocabulary, strip on export."""

    def to_megatron(self, layout, *hf):
        (tensor,) = hf
        pad = layout.padded_vocab_size - tensor.shape[0]
        if pad == 0:
            return tensor
        return torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])

    def to_hf(self, layout, tensor):
        return (tensor[: layout.vocab_size],)


class QKV(Transform):
    """`q_proj`, `k_proj`, `v_proj` (weights `[heads*hn, h]` or biases) <-> fused `linear_qkv`."""

    def to_megatron(self, layout, *hf):
        q, k, v = hf
        hn = layout.head_dim
        rest = q.shape[1:]
        return fuse_qkv(
            q.reshape(layout.num_heads, hn, *rest),
            k.reshape(layout.num_kv_heads, hn, *rest),
            v.reshape(layout.num_kv_heads, hn, *rest),
        )

    def to_hf(self, layout, tensor):
        q, k, v = unfuse_qkv(tensor, layout.num_heads, layout.num_kv_heads, layout.head_dim)
        rest = tensor.shape[1:]
        return tuple(t.reshape(-1, *rest) for t in (q, k, v))


class GLU(Transform):
    """`gate_proj`, `up_proj` `[ffn, h]` <-> SwiGLU `linear_fc1` `[2*ffn, h]` (gate first)."""

    def to_megatron(self, layout, *hf):
        return torch.cat(hf, dim=0)

    def to_hf(self, layout, tensor):
        return tuple(torch.chunk(tensor, 2, dim=0))


COPY, VOCAB, FUSED_QKV, SWIGLU = Transform(), Vocab(), QKV(), GLU()


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor <-> its HF tensors."""

    megatron: str
    hf: Tuple[str, ...]
    transform: Transform = COPY

    def format(self, megatron_prefix: str = "", hf_prefix: str = "", **placeholders) -> "Rule":
        """The rule with prefixes added and `{L}` / `{E}` filled in."""
        return Rule(
            (megatron_prefix + self.megatron).format(**placeholders),
            tuple((hf_prefix + name).format(**placeholders) for name in self.hf),
            self.transform,
        )


ATTENTION = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",)),
    Rule(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        FUSED_QKV,
    ),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
)
QKV_BIAS = (
    Rule(
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        FUSED_QKV,
    ),
)
QK_NORM = (
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), SWIGLU),
    Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)
_EXPERT = "mlp.experts.local_experts.{E}."


def _moe(router: str, experts: str, gate: str, up: str, down: str) -> Tuple[Rule, ...]:
    return (
        Rule("mlp.router.weight", (router,)),
        Rule(_EXPERT + "linear_fc1.weight", (experts + gate, experts + up), SWIGLU),
        Rule(_EXPERT + "linear_fc2.weight", (experts + down,)),
    )


QWEN_MOE = _moe("mlp.gate.weight", "mlp.experts.{E}.", "gate_proj.weight", "up_proj.weight",
                "down_proj.weight")
MIXTRAL_MOE = _moe("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{E}.", "w1.weight",
                   "w3.weight", "w2.weight")
# Tensors of Megatron's router and shared expert that only the native Qwen3-MoE modeling code
# (`megatron_mea.integrations.transformers.MegatronMoeBlock`) has; mapped where the checkpoint
# holds them.
MEGATRON_MOE_EXTRAS = (
    Rule("mlp.router.expert_bias", ("mlp.gate.expert_bias",)),
    Rule(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        SWIGLU,
    ),
    Rule("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",)),
)
GLOBAL = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
)
OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), VOCAB)

# The plugin's parameters: Megatron `self_attention.X` <-> HF (our modeling code) `self_attn.X`.
VARIANT_PARAMS = (
    "head_mix.key_weight",
    "head_mix.value_weight",
    "head_norm.weight",
    *(f"knock.{target}_{matrix}" for target in "qkv"
      for matrix in ("weight", "up", "gate", "down")),
)


@dataclass(frozen=True)
class Family:
    """One HF architecture.

    Attributes:
        name: our name (`llama`, `qwen2`, `qwen3`, `qwen3_moe`, `mixtral`) = HF `model_type`.
        architecture: HF causal-LM class name (`LlamaForCausalLM`...).
        qk_layernorm: per-head RMSNorm of q and k (`q_norm` / `k_norm`).
        add_qkv_bias: q/k/v projections have biases.
        moe: expert rules (None for dense families).
    """

    name: str
    architecture: str
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    moe: Optional[Tuple[Rule, ...]] = None
    attention: Tuple[Rule, ...] = field(default=ATTENTION)

    def layer_rules(self, moe_layer: bool, qk_layernorm: Optional[bool] = None
                    ) -> Tuple[Rule, ...]:
        """Relative rules of one layer (expert rules still hold `{E}`); `qk_layernorm`: the
        model's, where a native config overrides the family's."""
        rules = self.attention
        if self.add_qkv_bias:
            rules += QKV_BIAS
        if self.qk_layernorm if qk_layernorm is None else qk_layernorm:
            rules += QK_NORM
        return rules + (self.moe if moe_layer else DENSE_MLP)


FAMILIES: Dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("qwen2", "Qwen2ForCausalLM", add_qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", qk_layernorm=True),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_layernorm=True, moe=QWEN_MOE),
        Family("mixtral", "MixtralForCausalLM", moe=MIXTRAL_MOE),
    )
}


def family(name: str) -> Family:
    """The family called `name` (an HF `model_type`); ValueError listing the supported ones."""
    if name not in FAMILIES:
        raise ValueError(
            f"model_type {name!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[name]


def model_rules(
    fam: Family,
    num_layers: int,
    moe_layers: List[bool],
    num_experts: int,
    tied: bool,
    variant_params: Dict[int, List[str]],
    megatron_moe: Tuple[str, ...] = (),
    qk_layernorm: Optional[bool] = None,
) -> Dict[int, List[Rule]]:
    """All rules of a model, grouped by layer (key -1: embedding, final norm, output layer).

    Args:
        moe_layers: per layer, whether it is an MoE layer.
        variant_params: per layer, the plugin parameters (`VARIANT_PARAMS` names) it holds.
        megatron_moe: the Megatron tensor names of the model among `MEGATRON_MOE_EXTRAS` (the
            rules of those present are added; native Qwen3-MoE only).
        qk_layernorm: the model's QK norm, when a native config overrides the family's.
    """
    groups = {-1: list(GLOBAL) + ([] if tied else [OUTPUT])}
    for layer in range(num_layers):
        rules = []
        for rule in fam.layer_rules(moe_layers[layer], qk_layernorm):
            experts = range(num_experts) if "{E}" in rule.megatron else [None]
            for expert in experts:
                rules.append(
                    rule.format("decoder.layers.{L}.", "model.layers.{L}.", L=layer, E=expert)
                )
        for rule in MEGATRON_MOE_EXTRAS if moe_layers[layer] else ():
            formatted = rule.format("decoder.layers.{L}.", "model.layers.{L}.", L=layer)
            if formatted.megatron in megatron_moe:
                rules.append(formatted)
        for name in variant_params.get(layer, []):
            rules.append(
                Rule(f"decoder.layers.{layer}.self_attention.{name}",
                     (f"model.layers.{layer}.self_attn.{name}",))
            )
        groups[layer] = rules
    return groups
