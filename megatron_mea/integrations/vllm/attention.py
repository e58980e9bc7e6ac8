"""MEA / KHA self-attention on vLLM's layers: parallel linears, rotary embedding, `Attention`.

The order of operations is the Hugging Face classes' (`megatron_mea.integrations.transformers`)
and Megatron's:
split -> KHA -> q/k norm, MEA mixing -> k norm -> RoPE -> attention -> head norm -> `o_proj`.

KV cache, per layer and token:
- KHA, MEA with `nc == ng`: the `ng` composite K/V heads, as the stock model caches.
- MEA with virtual heads (`nc < ng`) and no k norm: the `nc` component heads, packed as one
  K/V head of size `nc*hn`. The mix is linear and RoPE acts alike on every head, so
  `q_h . k_g = sum_c A_k[c, g] (q_h . K_c) = q~_h . [K_0 ... K_nc-1]` with the mixed query
  `q~_h = [A_k[0, g] q_h ... A_k[nc-1, g] q_h]`, and the output is `sum_c A_v[c, g] (p_h @ V_c)`
  (the query-side trick). On CPU the cache is read by a backend of the plugin's
  (`components_cpu`, on vLLM's CPU cache and kernel): decode tokens by the trick (half the
  bytes of the original's cache), prefill chunks over the composite heads rebuilt from the
  components (`prefill`: the original's FLOPs, where the trick costs `nc` times them). On other
  devices vLLM's stock attention takes the trick for every token (one K/V head of size `nc*hn`
  multi-query, scale `hn**-0.5`; `nc*hn` up to 256 for FlashAttention). The cache holds `nc/ng`
  of the baseline's bytes.
- MEA with virtual heads and the k norm before the mix (`mea_key_norm_before_mix`): the
  component cache, over the normed components.
- MEA with virtual heads and an RMS k norm after the mix (Qwen3 families): the norm is `w`
  (channels) times one inverse RMS `r_g` per composite key and token, inside the softmax:
  `q_h . k_g = r_g q~_h . [K_0 ... K_nc-1]` with `K_c = RoPE(w * k_c)`. The cache holds the
  components and the `ng` scales per token, and the attention is `scaled_cache`'s (a backend of
  its own over vLLM's paged cache; decode batched and blockwise, `paged_decode`; prefill over
  the rebuilt composites, `prefill`): `(2*nc*hn + ng) / (2*ng*hn)` of the baseline's bytes.

The plugin's backends take the plain RoPE'd queries `q_h` (padded to the row width) and the
layer's head mix (`Attention`'s extra arguments), and return the composite heads' outputs
`o_h` (in the first `hn` of each head's output row).

Which of the three is cached is `ops.decode.CacheKind.choose`, as in Megatron's decoder.

Under tensor parallelism every rank computes all `nc` components (the mix needs each of them)
with replicated `k_proj` / `v_proj`; the query heads, `o_proj` and the composite heads are split
as in the stock models.

Shape legend: `T` tokens of the batch, `np` query heads (of this rank: `np_local`), `nc`
component heads, `ng` composite K/V heads, `hn` head dim.
"""

import logging

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.platforms import current_platform

from megatron_mea.integrations.transformers.modeling_megatron_mea import before_mix
from megatron_mea.ops.decode import CacheKind, inverse_rms

logger = logging.getLogger(__name__)


def variant_setting(config, name):
    """Variant field `name` of a native config (every field is written resolved)."""
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(
            f"{type(config).__name__} has no {name}: serve a native export "
            "(`mea-convert export-hf --format native`)"
        )
    return value


def _sharded_loader(rank, size):
    """A weight loader that copies this rank's `size` rows (dim 0) of the full tensor."""

    def load(param, loaded_weight):
        param.data.copy_(loaded_weight.narrow(0, rank * size, size))

    return load


class HeadNorm(nn.Module):
    """MEA's per-head RMS norm of the attention output; scale `[np*hn]`, this rank's heads."""

    def __init__(self, num_local_heads, head_dim, eps, rank):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_local_heads * head_dim))
        self.weight.weight_loader = _sharded_loader(rank, num_local_heads * head_dim)
        self.head_dim, self.eps = head_dim, eps

    def forward(self, x):
        """`x [T, np_local, hn]`, normalised per head in fp32."""
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (wide * self.weight.view(-1, self.head_dim).float()).to(x.dtype)


class VLLMHeadMix(nn.Module):
    """MEA HLC: `A_k`, `A_v` `[nc, ng]`, replicated on every rank (vLLM's counterpart of
    `layers.head_mix.HeadMix`; the weights load by the attribute name `head_mix`)."""

    def __init__(self, num_components, num_groups):
        super().__init__()
        self.key_weight = nn.Parameter(torch.empty(num_components, num_groups))
        self.value_weight = nn.Parameter(torch.empty(num_components, num_groups))

    def forward(self, key, value):
        """`[T, nc, hn]` -> `[T, ng, hn]` each."""
        return (torch.einsum("tcd,cg->tgd", key, self.key_weight),
                torch.einsum("tcd,cg->tgd", value, self.value_weight))


class Knock(nn.Module):
    """KHA: shared `[hn, hn]` transforms of the targeted heads (`x @ T`), or the gated MLP on
    the values; replicated on every rank."""

    def __init__(self, variant, targets, head_dim):
        super().__init__()
        self.variant, self.targets = variant, tuple(targets)
        names = [f"{t}_weight" for t in self.targets] if variant == "linear" else [
            "v_up", "v_gate", "v_down"]
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.empty(head_dim, head_dim)))

    def forward(self, query, key, value):
        """Heads `[T, heads, hn]` transformed, shapes kept."""
        if self.variant == "mlp":
            gate = torch.sigmoid(value @ self.v_gate)
            return query, key, 2 * ((value @ self.v_up) * gate) @ self.v_down
        heads = {"q": query, "k": key, "v": value}
        for target in self.targets:
            heads[target] = heads[target] @ getattr(self, f"{target}_weight")
        return heads["q"], heads["k"], heads["v"]


class VariantAttention(nn.Module):
    """vLLM self-attention of one decoder layer of a native MEA / KHA export.

    Checkpoint names (relative): `q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`,
    `head_mix.key_weight`, `head_mix.value_weight`, `head_norm.weight`, `knock.*`. KHA stacks
    q/k/v into `qkv_proj` (vLLM's `QKVParallelLinear`); MEA keeps three projections because
    `k_proj` / `v_proj` are replicated.
    """

    def __init__(self, config, cache_config, quant_config, prefix, qkv_bias=False,
                 qk_norm=False):
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        hidden, heads = config.hidden_size, config.num_attention_heads
        groups = config.num_key_value_heads
        hn = getattr(config, "head_dim", None) or hidden // heads
        variant = variant_setting(config, "attention_variant")
        if variant not in ("mea", "kha"):
            raise ValueError(f"attention_variant ({variant!r}) must be 'mea' or 'kha'")
        components = variant_setting(config, "mea_num_kv_components") if variant == "mea" \
            else groups
        if heads % tp or (groups % tp if groups >= tp else tp % groups):
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide num_attention_heads ({heads}) and "
                f"divide or be a multiple of num_key_value_heads ({groups})"
            )
        self.variant, self.head_dim, self.eps = variant, hn, config.rms_norm_eps
        self.num_components, self.num_groups = components, groups
        self.num_local_heads = heads // tp
        self.per_group = heads // groups
        first_head = rank * self.num_local_heads
        # Composite heads of this rank (one, replicated, when ng < tp).
        self.first_group = first_head // self.per_group
        self.num_local_groups = max(1, groups // tp)
        # The composite K/V head of each local query head, counted from this rank's first.
        local_group = (torch.arange(first_head, first_head + self.num_local_heads)
                       // self.per_group)
        self.register_buffer("local_group", local_group, persistent=False)

        if variant == "kha":
            self.qkv_proj = QKVParallelLinear(hidden, hn, heads, groups, bias=qkv_bias,
                                              quant_config=quant_config,
                                              prefix=f"{prefix}.qkv_proj")
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * hn, bias=qkv_bias,
                                               quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
            self.k_proj, self.v_proj = (
                ReplicatedLinear(hidden, components * hn, bias=qkv_bias,
                                 quant_config=quant_config, prefix=f"{prefix}.{name}")
                for name in ("k_proj", "v_proj")
            )
        self.o_proj = RowParallelLinear(heads * hn, hidden, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(hn, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hn, eps=config.rms_norm_eps) if qk_norm else None
        self.head_mix = self.head_norm = self.knock = None
        if variant == "mea":
            if variant_setting(config, "mea_hlc"):
                self.head_mix = VLLMHeadMix(components, groups)
            elif components != groups:
                raise ValueError(
                    f"mea_num_kv_components ({components}) < num_key_value_heads ({groups}) "
                    "needs mea_hlc"
                )
            if variant_setting(config, "mea_head_norm"):
                self.head_norm = HeadNorm(self.num_local_heads, hn, config.rms_norm_eps, rank)
        else:
            self.knock = Knock(variant_setting(config, "kha_variant"),
                               variant_setting(config, "kha_targets"), hn)
        self.rotary_emb = get_rope(hn, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters, is_neox_style=True)

        # Norm-then-mix (exports older than the field are mix-then-norm): the keys are linear
        # in the normed components, so they are cached as without a k norm.
        self.key_norm_before_mix = (variant == "mea" and qk_norm
                                    and bool(getattr(config, "mea_key_norm_before_mix", False)))
        # vLLM's RMSNorm is the only k norm of the families served.
        key_norm = "rms" if qk_norm and not self.key_norm_before_mix else None
        self.cache_kind = CacheKind.choose(components, groups, key_norm)
        self.attn = self._cache_attention(cache_config, quant_config, f"{prefix}.attn")

    def _cache_attention(self, cache_config, quant_config, prefix):
        """vLLM's `Attention` over this layer's cache (module docstring): composite heads, one
        head of `nc*hn` components, or that head with the `ng_loc` scales after its keys. The
        component layouts' own backends (on CPU for the plain one) take the plain queries and
        this layer's head mix, and return the composite heads' outputs."""
        hn, width = self.head_dim, self.num_components * self.head_dim
        shared = dict(cache_config=cache_config, quant_config=quant_config, prefix=prefix)
        mixing = dict(head_dim=hn, head_mix=self.head_mix, first_group=self.first_group)
        if self.cache_kind is CacheKind.COMPOSITES:
            return Attention(self.num_local_heads, hn, hn**-0.5,
                             num_kv_heads=self.num_local_groups, **shared)
        if self.cache_kind is CacheKind.COMPONENTS:
            if not current_platform.is_cpu():  # the stock backend, the query-side trick
                return Attention(self.num_local_heads, width, hn**-0.5, num_kv_heads=1,
                                 **shared)
            from megatron_mea.integrations.vllm.components_cpu import ComponentsCPUBackend

            return Attention(self.num_local_heads, width, hn**-0.5, num_kv_heads=1,
                             attn_backend=ComponentsCPUBackend,
                             num_groups=self.num_local_groups, **mixing, **shared)
        from megatron_mea.integrations.vllm.scaled_cache import ScaledComponentsBackend

        return Attention(self.num_local_heads, width + self.num_local_groups, hn**-0.5,
                         num_kv_heads=1, head_size_v=width,
                         attn_backend=ScaledComponentsBackend,
                         num_scales=self.num_local_groups, **mixing, **shared)

    @property
    def backend_mixes(self) -> bool:
        """Whether the attention backend takes the plain queries and mixes (component layouts
        with a backend of the plugin's), rather than the layer the query-side trick."""
        return self.attn.attn_backend.get_name() in ("MEA_SCALED_COMPONENTS", "MEA_COMPONENTS_CPU")

    def forward(self, positions, hidden_states):
        """`hidden_states [T, h]` -> `[T, h]`."""
        tokens, hn = hidden_states.shape[0], self.head_dim
        query, key, value = self._project(hidden_states)  # [T, heads, hn] each
        query, key, value = before_mix(self, query, key, value)
        if self.cache_kind is CacheKind.COMPOSITES:
            output = self._attend_composites(positions, query, key, value)
        else:
            output = self._attend_components(positions, query, key, value)
        if self.head_norm is not None:
            output = self.head_norm(output)
        output, _ = self.o_proj(output.reshape(tokens, self.num_local_heads * hn))
        return output

    def _project(self, hidden_states):
        """Query heads of this rank and the K/V heads it holds: components (MEA, all of them)
        or composite heads (KHA, this rank's); `[T, heads, hn]` each."""
        tokens, hn = hidden_states.shape[0], self.head_dim
        if self.variant == "kha":
            qkv, _ = self.qkv_proj(hidden_states)
            kv = self.num_local_groups * hn
            query, key, value = qkv.split([self.num_local_heads * hn, kv, kv], dim=-1)
        else:
            query, _ = self.q_proj(hidden_states)
            key, _ = self.k_proj(hidden_states)
            value, _ = self.v_proj(hidden_states)
        return (t.reshape(tokens, -1, hn) for t in (query, key, value))

    def _rope(self, positions, query, key):
        tokens = query.shape[0]
        query, key = self.rotary_emb(positions, query.reshape(tokens, -1),
                                     key.reshape(tokens, -1))
        return query, key

    def _attend_composites(self, positions, query, key, value):
        """Mix (MEA), k norm, RoPE; attention over this rank's composite heads."""
        if self.variant == "mea":
            if self.head_mix is not None:
                key, value = self.head_mix(key, value)
            local = slice(self.first_group, self.first_group + self.num_local_groups)
            key, value = key[:, local], value[:, local]
        if self.k_norm is not None and not self.key_norm_before_mix:
            key = self.k_norm(key)
        query, key = self._rope(positions, query, key)
        output = self.attn(query, key, value.reshape(value.shape[0], -1))
        return output.view(query.shape[0], self.num_local_heads, self.head_dim)

    def _attend_components(self, positions, query, key, value):
        """One cached K/V head of size `nc*hn`, with the scales `r_g` of this rank's composite
        keys after the keys (`SCALED_COMPONENTS`). The plugin's backends take the plain queries
        (padded to the key row's width) and return `o_h`; vLLM's stock one on other devices
        takes the query-side trick (module docstring)."""
        tokens, hn = query.shape[0], self.head_dim
        scaled = self.cache_kind is CacheKind.SCALED_COMPONENTS
        if scaled:
            local = slice(self.first_group, self.first_group + self.num_local_groups)
            mixed = torch.einsum("tcd,cg->tgd", key, self.head_mix.key_weight[:, local])
            scales = inverse_rms(mixed, self.k_norm.variance_epsilon).to(key.dtype)  # [T, ng]
            key = key * self.k_norm.weight
        query, key = self._rope(positions, query, key)
        if scaled:
            key = torch.cat([key, scales], dim=-1)
        query = query.view(tokens, self.num_local_heads, hn)
        if self.backend_mixes:  # the pad is not read
            query = nn.functional.pad(query, (0, self.attn.head_size - hn))
            output = self.attn(query.reshape(tokens, -1), key, value.reshape(tokens, -1))
            return output.view(tokens, self.num_local_heads, -1)[:, :, :hn]
        key_mix = self.head_mix.key_weight[:, self.local_group].t()  # [np_local, nc]
        value_mix = self.head_mix.value_weight[:, self.local_group].t()
        query = query.view(tokens, self.num_local_heads, 1, hn) * key_mix[None, :, :, None]
        output = self.attn(query.reshape(tokens, -1), key, value.reshape(tokens, -1))
        output = output.view(tokens, self.num_local_heads, self.num_components, hn)
        return torch.einsum("thcd,hc->thd", output, value_mix)

    def load_weights(self, weights):
        """Load `(name, tensor)` pairs named relative to this module; returns the names of
        the parameters loaded. KHA's `q_proj` / `k_proj` / `v_proj` go into `qkv_proj`."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            shard = None
            if self.variant == "kha" and name.split(".")[0] in ("q_proj", "k_proj", "v_proj"):
                shard = name[0]
                name = "qkv_proj." + name.split(".", 1)[1]
            if name not in params:
                raise ValueError(f"unexpected weight self_attn.{name} for a "
                                 f"{self.variant.upper()} layer")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded
