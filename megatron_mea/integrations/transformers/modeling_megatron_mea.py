"""Hugging Face causal LMs with MEA / KHA attention, for evaluating models the plugin trained.

Each class is the stock family model (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral) whose every
`self_attn` is a `VariantAttention`: the same `q_proj` / `k_proj` / `v_proj` / `o_proj` (and
`q_norm` / `k_norm`) plus the plugin's parameters under the names Megatron uses
(`self_attn.head_mix.key_weight`, `self_attn.head_norm.weight`, `self_attn.knock.v_up`...).
The order of operations is Megatron's: split -> KHA -> q/k norm, MEA mixing -> k norm
-> RoPE -> attention -> head norm -> `o_proj`. RoPE is the stock model's rotary embedding, built
from `config.rope_parameters` (llama3 frequency scaling included).

KV cache. With MEA virtual heads (`nc < ng`) the cache holds what `nc` components need, so
`generate` keeps `nc/ng` of the baseline's K/V: per layer and token, keys `RoPE(w * k_c)` (`w`
the k norm's scale, if any) and values `v_c`, followed by the k norm's inverse RMS of every
composite key (`ng` scalars), packed as one pseudo-head: keys `[b, 1, T, nc*hn]`, values
`[b, 1, T, nc*hn (+ ng)]` (stock `DynamicCache`s take any such shape). The mix is linear and the
RMS norm is that scale times one scalar per composite key, so the attention over the cache is
exact with the mix moved to the query side: `q_h . k_g = r_g sum_c A_k[c, g] (q_h . K_c)`, and
`sum_c A_v[c, g] (p_h @ V_c)` for the values. The prompt (an empty cache) attends through the
composite heads; otherwise (KHA, `nc == ng`) the cache holds the composite heads as usual.
With `mea_key_norm_before_mix` (norm-then-mix) the k norm acts on each component key before the
mix, and the cache holds the normed components without scalars.

Self-contained (imports torch, transformers and the sibling configuration file) so that an export
can carry it for `trust_remote_code=True`. Written against transformers 5.x.

Shape legend: `b` batch, `s` sequence, `np` query heads, `nc` component K/V heads, `ng` K/V heads
seen by attention, `hn` head dim.
"""

import torch
from torch import nn
from transformers import (
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

from .configuration_megatron_mea import (
    MegatronMEALlamaConfig,
    MegatronMEAMixtralConfig,
    MegatronMEAQwen2Config,
    MegatronMEAQwen3Config,
    MegatronMEAQwen3MoeConfig,
)


def variant_setting(config, name):
    """Variant field `name` of `config`. `mea-convert export-hf` writes every field resolved, so
    there are no defaults here to disagree with the training config's."""
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(
            f"{type(config).__name__} has no {name}: a native config.json carries every variant "
            "field (export the checkpoint with `mea-convert export-hf --format native`)"
        )
    return value


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 (Qwen3's `q_norm` / `k_norm`)."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


class HeadMix(nn.Module):
    """MEA HLC: composite K/V heads from component heads, `A_k`, `A_v` `[nc, ng]`."""

    def __init__(self, num_components, num_groups):
        super().__init__()
        self.key_weight = nn.Parameter(torch.eye(num_components, num_groups))
        self.value_weight = nn.Parameter(torch.eye(num_components, num_groups))

    def forward(self, key, value):
        """`[b, s, nc, hn]` -> `[b, s, ng, hn]` each."""
        mix = "bsjd,jh->bshd"
        return torch.einsum(mix, key, self.key_weight), torch.einsum(mix, value, self.value_weight)


class HeadNorm(nn.Module):
    """MEA head-level RMS norm of the attention output, scale `[np*hn]`."""

    def __init__(self, num_heads, head_dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps

    def forward(self, x):
        """`x [b, s, np, hn]`, normalised per head in fp32."""
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.view(self.num_heads, self.head_dim).float()
        return (wide * weight).to(x.dtype)


class Knock(nn.Module):
    """KHA on each target (q, k, v): a shared `[hn, hn]` transform `x @ T` (`linear`), the gated
    MLP `2 * ((x @ W_up) * sigmoid(x @ W_gate)) @ W_down` (`mlp`) or the gate alone
    `2 * x * sigmoid(x @ W_gate)` (`gate`). Parameters `{target}_weight|up|gate|down`."""

    MATRICES = {"linear": ("weight",), "mlp": ("up", "gate", "down"), "gate": ("gate",)}

    def __init__(self, variant, targets, head_dim):
        super().__init__()
        if variant not in self.MATRICES:
            raise ValueError(f"kha_variant ({variant!r}) must be one of {tuple(self.MATRICES)}")
        self.variant, self.targets = variant, tuple(targets)
        for target in self.targets:
            for name in self.MATRICES[variant]:
                init = torch.zeros(head_dim, head_dim) if name == "gate" else torch.eye(head_dim)
                self.register_parameter(f"{target}_{name}", nn.Parameter(init))

    def _transform(self, x, target):
        if self.variant == "linear":
            return x @ getattr(self, f"{target}_weight")
        gate = torch.sigmoid(x @ getattr(self, f"{target}_gate"))
        if self.variant == "gate":
            return 2 * x * gate
        up, down = getattr(self, f"{target}_up"), getattr(self, f"{target}_down")
        return 2 * ((x @ up) * gate) @ down

    def forward(self, query, key, value):
        """Transform `[b, s, heads, hn]` heads, shapes kept."""
        heads = {"q": query, "k": key, "v": value}
        for target in self.targets:
            heads[target] = self._transform(heads[target], target)
        return heads["q"], heads["k"], heads["v"]


def _component_attention(query, keys, values, num_scales, key_mix, value_mix, scaling, mask):
    """Attention over a component cache (see the module docstring).

    Args:
        query: `[b, np, s, hn]`, RoPE'd; query i sits at position `T - s + i`.
        keys: `[b, 1, T, nc*hn]`; values: `[b, 1, T, nc*hn + num_scales]`.
        num_scales: ng when the values carry the inverse RMS of each composite key, else 0.
        key_mix, value_mix: `A_k`, `A_v` `[nc, ng]`.
        scaling: the softmax scale.
        mask: None (causal), bool (True = attend) or additive float, `[b, 1, s, >=T]`.

    Returns:
        `[b, s, np, hn]`.
    """
    b, num_heads, s, hn = query.shape
    num_cached, nc = keys.shape[2], key_mix.shape[0]
    per_group = num_heads // key_mix.shape[1]
    keys, values = keys[:, 0], values[:, 0]
    mixed = torch.einsum("bhsd,ch->bhscd", query, key_mix.repeat_interleave(per_group, 1))
    scores = torch.matmul(mixed.reshape(b, num_heads * s, nc * hn), keys.transpose(1, 2))
    scores = scores.view(b, num_heads, s, num_cached).float() * scaling
    if num_scales:
        inverse_rms = values[..., nc * hn :].float().transpose(1, 2)  # [b, ng, T]
        scores = scores * inverse_rms.repeat_interleave(per_group, 1)[:, :, None, :]
    if mask is None:
        causal = torch.ones(s, num_cached, dtype=torch.bool, device=query.device)
        scores = scores.masked_fill(causal.triu(num_cached - s + 1), float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., :num_cached], float("-inf"))
    else:
        scores = scores + mask[..., :num_cached]
    probs = scores.softmax(dim=-1).to(query.dtype).view(b, num_heads * s, num_cached)
    out = torch.matmul(probs, values[..., : nc * hn]).view(b, num_heads, s, nc, hn)
    return torch.einsum("bhscd,ch->bshd", out, value_mix.repeat_interleave(per_group, 1))


def before_mix(attention, query, key, value):
    """What an attention of a native export does to its split heads `[..., heads, hn]` before
    the MEA mix: KHA, the q norm, and the k norm when it comes first (norm-then-mix).

    Args:
        attention: this file's `VariantAttention` or vLLM's (`megatron_mea.integrations.vllm`):
            its `knock`, `q_norm` (None when absent), `k_norm` and `key_norm_before_mix`.

    Returns:
        query, key, value, shapes kept.
    """
    if attention.knock is not None:
        query, key, value = attention.knock(query, key, value)
    if attention.q_norm is not None:
        query = attention.q_norm(query)
    if attention.key_norm_before_mix:
        key = attention.k_norm(key)
    return query, key, value


class VariantAttention(nn.Module):
    """Self-attention with MEA or KHA (or standard, in a native export that needs the native
    model for something else: Megatron's router, no QK norm), a drop-in for the family's
    attention module."""

    def __init__(self, config, layer_idx, qkv_bias=False, qk_norm=False):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        groups = config.num_key_value_heads
        variant = variant_setting(config, "attention_variant")
        components = groups
        if variant == "mea":
            components = variant_setting(config, "mea_num_kv_components")
        self.num_heads, self.num_components = heads, components
        self.num_key_value_groups = heads // groups
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.is_causal = True
        hn = self.head_dim
        self.q_proj = nn.Linear(hidden, heads * hn, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, components * hn, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, components * hn, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * hn, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(hn, config.rms_norm_eps)
            self.k_norm = RMSNorm(hn, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.head_mix = self.head_norm = self.knock = None
        if variant == "mea":
            if variant_setting(config, "mea_hlc"):
                self.head_mix = HeadMix(components, groups)
            if variant_setting(config, "mea_head_norm"):
                self.head_norm = HeadNorm(heads, hn, config.rms_norm_eps)
        elif variant == "kha":
            kha = variant_setting(config, "kha_variant")
            self.knock = Knock(kha, variant_setting(config, "kha_targets"), hn)
        elif variant != "standard":  # standard: a native export for its router or its norms
            raise ValueError(f"attention_variant ({variant!r}) must be 'standard', 'mea' or 'kha'")
        # Norm-then-mix: the k norm on the components (exports older than the field are
        # mix-then-norm, so a missing field means False).
        self.key_norm_before_mix = (variant == "mea" and qk_norm
                                    and bool(getattr(config, "mea_key_norm_before_mix", False)))
        # Virtual heads cache their components (nc/ng of the memory); nc == ng, the composites.
        self.caches_components = components < groups

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        """Same contract as the family's attention: returns (output `[b, s, h]`, weights)."""
        cache = cache if cache is not None else past_key_values
        b, s = hidden_states.shape[:2]
        hn = self.head_dim
        query = self.q_proj(hidden_states).view(b, s, self.num_heads, hn)
        key = self.k_proj(hidden_states).view(b, s, self.num_components, hn)
        value = self.v_proj(hidden_states).view(b, s, self.num_components, hn)
        query, key, value = before_mix(self, query, key, value)
        weights = None
        if self.caches_components and cache is not None:
            output = self._attend_with_component_cache(
                query, key, value, position_embeddings, attention_mask, cache, kwargs
            )
        else:
            if self.head_mix is not None:
                key, value = self.head_mix(key, value)
            query, key, value = self._rope_and_transpose(query, key, value, position_embeddings)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
            output, weights = self._attend(query, key, value, attention_mask, kwargs)
        if self.head_norm is not None:
            output = self.head_norm(output)
        return self.o_proj(output.reshape(b, s, -1).contiguous()), weights

    def _norm_composite_key(self, key):
        """The k norm of composite keys: mix-then-norm only."""
        if self.k_norm is None or self.key_norm_before_mix:
            return key
        return self.k_norm(key)

    def _rope_and_transpose(self, query, key, value, position_embeddings):
        """k norm, then `[b, s, heads, hn]` -> RoPE'd `[b, heads, s, hn]`."""
        key = self._norm_composite_key(key)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        return query, key, value

    def _attend(self, query, key, value, attention_mask, kwargs):
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        return attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs,
        )

    def _attend_with_component_cache(self, query, key, value, position_embeddings,
                                     attention_mask, cache, kwargs):
        """Cache this step's component entries; attend over the whole cache from them (or, for
        the prompt, through the composite heads). Returns `[b, s, np, hn]`."""
        b, s = query.shape[:2]
        past = cache.get_seq_length(self.layer_idx)
        composite_key, composite_value = self.head_mix(key, value)
        cached_value = value.reshape(b, 1, s, -1)
        if self.k_norm is not None and not self.key_norm_before_mix:
            wide = composite_key.float()
            inverse_rms = torch.rsqrt(wide.pow(2).mean(-1) + self.k_norm.eps)  # [b, s, ng]
            cached_value = torch.cat([cached_value, inverse_rms.to(value.dtype)[:, None]], -1)
            key = key * self.k_norm.weight  # elementwise, the same for every head: commutes
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        cached_key = key.transpose(1, 2).reshape(b, 1, s, -1)
        keys, values = cache.update(cached_key, cached_value, self.layer_idx, kwargs=kwargs)
        if past == 0:  # the prompt: through the composite heads, as without a cache
            composite_key = self._norm_composite_key(composite_key)
            _, composite_key = apply_rotary_pos_emb(query, composite_key.transpose(1, 2), cos, sin)
            composite_value = composite_value.transpose(1, 2)
            return self._attend(query, composite_key, composite_value, attention_mask, kwargs)[0]
        num_scales = values.shape[-1] - keys.shape[-1]
        return _component_attention(
            query, keys, values, num_scales, self.head_mix.key_weight,
            self.head_mix.value_weight, self.scaling, attention_mask,
        )


class MegatronRouter(nn.Module):
    """Megatron-Core's top-k router (`TopKRouter`, `topk_routing_with_score_function`), in place
    of the stock `gate`: same `weight` `[E, h]`, plus the expert bias when the model has one.

    Scores: `softmax` over the k largest logits (`moe_router_pre_softmax` false: Mixtral /
    Qwen3-MoE with `norm_topk_prob`), or softmax over all experts then the k largest (true:
    `norm_topk_prob` false); `sigmoid` per expert, the k largest of `sigmoid + expert_bias`
    chosen (the bias only chooses), their sigmoids renormalised to sum 1 (k > 1). Then the
    weights are multiplied by `moe_router_topk_scaling_factor`, if set.
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.hidden_dim = config.hidden_size
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def forward(self, hidden_states):
        """`[t, h]` -> (logits `[t, E]`, weights `[t, k]`, experts `[t, k]`)."""
        logits = nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        if self.score_function == "softmax":
            if self.pre_softmax:
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                weights, experts = torch.topk(scores, self.top_k, dim=-1)
            else:
                top, experts = torch.topk(logits, self.top_k, dim=-1)
                weights = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
        else:
            scores = torch.sigmoid(logits.float()).type_as(logits)
            if self.expert_bias is None:
                weights, experts = torch.topk(scores, self.top_k, dim=-1)
            else:
                _, experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
                weights = torch.gather(scores, 1, experts)
            if self.top_k > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor:
            weights = weights * self.scaling_factor
        return logits, weights, experts


class MegatronMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen3-MoE's sparse block with Megatron's router and, if the model has one, Megatron's
    (ungated) shared expert added to the routed experts' output."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = MegatronRouter(config)
        size = config.moe_shared_expert_intermediate_size
        self.shared_expert = Qwen3MoeMLP(config, intermediate_size=size) if size else None

    def forward(self, hidden_states):
        """`[b, s, h]` -> `[b, s, h]`."""
        routed = super().forward(hidden_states)
        if self.shared_expert is None:
            return routed
        return routed + self.shared_expert(hidden_states)


def _variant_model(base, config_class, qkv_bias=False, qk_norm=False):
    """`MegatronMEA<Base>`: the stock causal LM `base` with every `self_attn` a
    `VariantAttention` (q/k/v biases like Qwen2, q/k norms like Qwen3) and, for Qwen3-MoE
    configs that name Megatron's router (`moe_router_score_function`), every sparse block a
    `MegatronMoeBlock`."""

    def __init__(self, config):
        base.__init__(self, config)
        megatron_router = getattr(config, "moe_router_score_function", None) is not None
        # A Qwen3-MoE config may say qk_layernorm false: an MoE model without QK norm that
        # Mixtral (no dense layers, no Megatron router) cannot express.
        qk = getattr(config, "qk_layernorm", qk_norm)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = VariantAttention(config, index, qkv_bias=qkv_bias, qk_norm=qk)
            if megatron_router and isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                layer.mlp = MegatronMoeBlock(config)
        self.post_init()

    name = "MegatronMEA" + base.__name__
    family = base.__name__[: -len("ForCausalLM")]
    return type(name, (base,), {
        "__init__": __init__,
        "__doc__": f"{family} with MEA / KHA attention.",
        "__module__": __name__,
        "__qualname__": name,
        "config_class": config_class,
    })


# Module-level names: `auto_map` and `trust_remote_code=True` look the classes up by name.
MegatronMEALlamaForCausalLM = _variant_model(LlamaForCausalLM, MegatronMEALlamaConfig)
MegatronMEAQwen2ForCausalLM = _variant_model(Qwen2ForCausalLM, MegatronMEAQwen2Config,
                                             qkv_bias=True)
MegatronMEAQwen3ForCausalLM = _variant_model(Qwen3ForCausalLM, MegatronMEAQwen3Config,
                                             qk_norm=True)
MegatronMEAQwen3MoeForCausalLM = _variant_model(Qwen3MoeForCausalLM, MegatronMEAQwen3MoeConfig,
                                                qk_norm=True)
MegatronMEAMixtralForCausalLM = _variant_model(MixtralForCausalLM, MegatronMEAMixtralConfig)


MODELS = {
    cls.config_class.model_type: cls
    for cls in (
        MegatronMEALlamaForCausalLM,
        MegatronMEAQwen2ForCausalLM,
        MegatronMEAQwen3ForCausalLM,
        MegatronMEAQwen3MoeForCausalLM,
        MegatronMEAMixtralForCausalLM,
    )
}


def _register_weight_conversions():
    # transformers 5 fuses MoE experts at load time through per-model_type conversion rules;
    # our model types reuse their base family's rules (checkpoints keep the per-expert layout).
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    for model_type, cls in MODELS.items():
        base = cls.config_class.__mro__[1].model_type
        mapping = get_checkpoint_conversion_mapping(base)
        if mapping:
            register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)


_register_weight_conversions()
