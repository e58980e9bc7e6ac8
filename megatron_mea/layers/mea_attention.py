"""MEA self-attention: Megatron's `SelfAttention` with HLC over the K/V heads, a per-head RMS norm
of the output, and decoding straight from the component KV cache.

Shape legend: `s` sequence (full, also under SP: `linear_qkv` gathers it), `b` batch, `np_loc`
local query heads, `nc_loc` / `ng_loc` local component / composite K/V heads, `hn` head dim.
"""

import copy
import dataclasses
import logging
from typing import Union

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import deprecate_inference_params, divide, get_pg_rank

from megatron_mea.layers.attention import _SplitSelfAttention
from megatron_mea.layers.head_norm import HEAD_NORMED_PROJECTIONS
from megatron_mea.layers.kv_cache import (
    CacheKind,
    DecodeStep,
    MEAKVCache,
    QuerySideMix,
    attend,
    rms_factors,
)
from megatron_mea.ops.decode import decode_mask, inverse_rms
from megatron_mea.ops.qkv_layout import unfuse_qkv
from megatron_mea.parallel import ExchangeShape, choose_exchange, gather_features

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class MEASelfAttentionSubmodules(SelfAttentionSubmodules):
    """Megatron's self-attention submodules plus MEA's pieces, as the spec builds them
    (`megatron_mea.specs`). With the head norm, `linear_proj` is the spec's row-parallel linear
    with the norm first (`head_norm.head_normed_projection`).

    Args:
        head_mix: HLC over the K/V heads (`HeadMix`), built with `(config, tp_group,
            num_components)`; None for the head-norm-only control (`mea_hlc=False`).
        head_norm: the per-head RMS norm of the output (`HeadRMSNorm`), built with `(config,
            tp_group)`; None without it (`mea_head_norm=False`).
    """

    head_mix: Union[ModuleSpec, type, None] = None
    head_norm: Union[ModuleSpec, type, None] = None


def _check_matches_config(config, submodules) -> None:
    """The spec's pieces are those `config` describes (the HF export, the size accounting and
    the checkpoint checks read the config)."""
    if not isinstance(submodules, MEASelfAttentionSubmodules):
        raise TypeError(
            f"MEASelfAttention takes MEASelfAttentionSubmodules, got {type(submodules).__name__}: "
            "build its spec with megatron_mea.specs (get_gpt_layer_spec, apply_attention_variant)"
        )
    pieces = {"mea_hlc": ("head_mix", submodules.head_mix),
              "mea_head_norm": ("head_norm", submodules.head_norm)}
    for field, (name, piece) in pieces.items():
        if bool(getattr(config, field)) != (piece is not None):
            raise ValueError(
                f"{field}={getattr(config, field)} but the spec's {name} is {piece!r}: build "
                "the spec from this config (megatron_mea.specs)"
            )
    if submodules.head_norm is not None:
        projection = submodules.linear_proj
        if getattr(projection, "module", projection) not in HEAD_NORMED_PROJECTIONS.values():
            raise ValueError(
                f"the head norm runs inside linear_proj, so it must be a head-normed projection "
                f"(head_normed_projection), got {projection!r}"
            )


def component_view(config, num_components):
    """`config` as Megatron's `SelfAttention.__init__` must see it to size `linear_qkv` for
    `nc` K/V heads: a shallow copy whose `num_query_groups` is `num_components`."""
    view = copy.copy(config)
    view.num_query_groups = num_components
    return view


class MEASelfAttention(_SplitSelfAttention):
    """Multi-head explicit attention: HLC over K/V heads plus a per-head RMS norm of the output.

    `linear_qkv` produces `nc` component K/V heads (`mea_num_kv_components`), `head_mix` (HLC)
    composes the `ng` composite heads the attention uses. With `nc < ng` ("virtual heads") the
    projection and the KV cache shrink to `nc/ng` of GQA's. With fewer components than TP ranks
    (`nc < t`) the projection output is all-gathered: every rank holds (and caches) all `nc`
    components, keeps its own `np/t` query heads and expands to its own composite heads.

    Which step runs where. `forward` sends training and cache-free evaluation to Megatron's
    `Attention.forward` (which calls `get_query_key_value_tensors`, RoPE, `core_attention`,
    `linear_proj`), and a static inference context to `_forward_with_cache`:

    | step       | training, no cache        | prefill (offset 0)      | decode (offset > 0)      |
    |------------|---------------------------|-------------------------|--------------------------|
    | projection | `_project_components`, or | `_project_components`   | `_project_components`    |
    |            | `_project_composites_     |                         |                          |
    |            | folded` (`weights`)       |                         |                          |
    | HLC        | `mix_heads` (or the fold) | `mix_heads`             | query side (`attend`)    |
    | q/k norms  | `_norm_query`/`_norm_key` | same                    | k norm split: its scale  |
    |            |                           |                         | into the cache, 1/rms    |
    |            |                           |                         | cached per composite key |
    | RoPE       | Megatron's forward        | `_rope`                 | `_rope`, new tokens only |
    | cache      | none                      | `_cache_entries`        | `_cache_entries`         |
    | attention  | `core_attention`          | `core_attention`        | `kv_cache.attend`        |
    | head norm  | `linear_proj` (`HeadNormedInput`) | same            | same                     |

    With `mea_key_norm_before_mix` the k norm acts on the component keys before HLC
    (`_norm_component_key`) and not on the composites (`_norm_key` is then the identity).

    The cache (`kv_cache.py`, one `CacheKind`) holds the RoPE'd components (with one inverse RMS
    per composite key under an RMS k norm after the mix; normed components under
    norm-then-mix) when `nc < ng`, or the composites (when `nc == ng` or the k norm is not
    RMS-type). Megatron's dynamic (paged) context is not supported (see
    docs/inference-decode.md).

    TP exchange of training forwards (`mea_tp_exchange`, docs/tensor-parallel.md):
    - `activations`: project the components, mix the activations (`head_mix.forward`);
    - `weights`: fold HLC into the K/V rows (`head_mix.fold`) and run `linear_qkv` with the folded
      weight, which yields composite heads directly; with `enable_fold_cache` the fold is built
      once per optimizer step;
    - `auto`: per micro-batch, whichever sends fewer elements (`parallel/exchange.py`).
    Evaluation always projects the components.
    """

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        """Arguments as `_SplitSelfAttention`'s (Megatron's `SelfAttention`)."""
        _check_matches_config(config, submodules)
        # Megatron sizes linear_qkv from num_query_groups: its submodules are built from the
        # component view; `self.config` is the real one for everything downstream of HLC.
        self.num_components = config.kv_components(layer_number)
        super().__init__(
            config,
            submodules,
            layer_number,
            *args,
            projection_config=component_view(config, self.num_components),
            **kwargs,
        )
        self.components_duplicated = self.num_components < self.world_size
        # Decode over split components: partial scores meet in reduce-scatters (`kv_cache`).
        self.components_sharded = self.world_size > 1 and not self.components_duplicated
        if self.components_duplicated:
            # Megatron's "fewer groups than ranks" sizes assume one group and np/nc query heads
            # per rank; here each rank keeps np/t query heads and all nc components.
            self.num_attention_heads_per_partition = divide(
                config.num_attention_heads, self.world_size
            )
            self.num_query_groups_per_partition = self.num_components
        # mea_hlc=False (the head-norm-only control, nc == ng): no composition, so nothing to
        # fold either; the `activations` path then skips the mixing (`mix_heads`).
        self.head_mix = None
        self.exchange = "activations"
        if submodules.head_mix is not None:
            self.head_mix = build_module(
                submodules.head_mix, config, self.tp_group, self.num_components
            )
            # The k norm before the mix does not fold into the weights (`auto` -> activations;
            # the config refuses `weights`).
            if not config.mea_key_norm_before_mix:
                self.exchange = config.mea_tp_exchange
        self.exchange_shape = ExchangeShape(
            num_heads=config.num_attention_heads,
            num_groups=config.num_query_groups,
            num_components=self.num_components,
            head_dim=self.hidden_size_per_attention_head,
            hidden_size=config.hidden_size,
            tp_size=self.world_size,
            bias=self._qkv_bias() is not None,
        )
        if self.exchange != "activations":
            self._enable_folded_projection()
        self.head_norm = None
        if submodules.head_norm is not None:
            self.head_norm = build_module(submodules.head_norm, config, self.tp_group)
            self.linear_proj.use_head_norm(self.head_norm)
        self.has_key_norm = not isinstance(self.k_layernorm, (IdentityOp, type(None)))
        self.key_norm_factors = rms_factors(self.k_layernorm) if self.has_key_norm else None
        self.cache_kind = self._choose_cache_kind()
        self._warned = False

    # ---- training and cache-free forwards (Megatron's forward calls these) -------------------

    def _use_folded_weight(self, hidden_states) -> bool:
        if self.exchange == "activations" or not self.training:
            return False
        if self.exchange == "weights" or (self.fold_cache is not None and self.fold_cache.live):
            return True
        tokens = hidden_states.shape[0] * hidden_states.shape[1]
        if self.config.sequence_parallel:
            tokens *= self.world_size  # linear_qkv gathers the sequence
        return choose_exchange(self.exchange_shape, tokens) == "weights"

    def _project_components(self, hidden_states):
        """`[s, b, h]` -> query `[s, b, np_loc, hn]`, component key and value `[s, b, nc_loc, hn]`
        (all `nc` when duplicated)."""
        if not self.components_duplicated:
            return self._project_and_split(hidden_states, None)
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        # Every rank needs all nc components; the gather's backward sums the ranks' uses.
        mixed_qkv = gather_features(mixed_qkv, self.tp_group)
        hn = self.hidden_size_per_attention_head
        query, key, value = unfuse_qkv(
            mixed_qkv, self.config.num_attention_heads, self.num_components, hn, dim=-1
        )
        heads = self.num_attention_heads_per_partition
        start = get_pg_rank(self.tp_group) * heads
        return query[:, :, start : start + heads], key, value

    def _project_composites_folded(self, hidden_states):
        """The `weights` exchange: HLC folded into the K/V rows; composite K/V come out."""
        num_heads = self.config.num_attention_heads
        return self._project_folded(
            hidden_states,
            None,
            lambda weight, bias: self.head_mix.fold(weight, bias, num_heads),
            [self.head_mix.key_weight, self.head_mix.value_weight],
            self.config.num_query_groups // self.world_size,
        )

    def mix_heads(self, key, value):
        """HLC: component key and value `[s, b, nc_loc, hn]` -> composite `[s, b, ng_loc, hn]`
        (unchanged without HLC, where components are the composites)."""
        if self.head_mix is None:
            return key, value
        return self.head_mix(key, value)

    def _norm_query(self, query):
        return query if self.q_layernorm is None else self.q_layernorm(query)

    def _norm_key(self, key):
        """The k norm of composite keys (mix-then-norm); identity under norm-then-mix."""
        if self.k_layernorm is None or self.config.mea_key_norm_before_mix:
            return key
        return self.k_layernorm(key)

    def _norm_component_key(self, key):
        """The k norm of component keys (norm-then-mix); identity under mix-then-norm."""
        if self.k_layernorm is None or not self.config.mea_key_norm_before_mix:
            return key
        return self.k_layernorm(key)

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """`[s, b, h]` -> query `[s, b, np_loc, hn]`, composite key and value `[s, b, ng_loc, hn]`,
        q/k-normed (Megatron's forward applies RoPE next)."""
        if key_value_states is not None:
            raise ValueError("the MEA / KHA variants are self-attention only")
        if self._use_folded_weight(hidden_states):
            query, key, value = self._project_composites_folded(hidden_states)
        else:
            query, key, value = self._project_components(hidden_states)
            key, value = self.mix_heads(self._norm_component_key(key), value)
        return self._norm_query(query), self._norm_key(key), value

    # ---- inference -----------------------------------------------------------------------

    def _choose_cache_kind(self) -> CacheKind:
        # Keys normed before the mix need no scale: the (normed) components are all they need.
        key_norm = None if not self.has_key_norm or self.config.mea_key_norm_before_mix else (
            "rms" if self.key_norm_factors is not None else "other")
        return CacheKind.choose(self.num_components, self.config.num_query_groups, key_norm)

    def _warn_composite_cache(self):
        if self.num_components < self.config.num_query_groups and not self._warned:
            self._warned = True
            logger.warning(
                "MEA layer %d: k_layernorm %s is not an RMS-type norm, so the KV cache holds "
                "the %d composite heads, not the %d components", self.layer_number,
                type(self.k_layernorm).__name__, self.config.num_query_groups,
                self.num_components,
            )

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        *args,
        inference_params=None,
        **megatron_kwargs,
    ):
        """Without an inference context, Megatron's forward (training, evaluation); with a
        static one, `_forward_with_cache` (prefill and decode). Returns `(output, bias)`.

        Arguments as Megatron's `Attention.forward`; Megatron's layers pass all but the first
        two by keyword (`rotary_pos_emb`, `packed_seq_params`, ...)."""
        context = deprecate_inference_params(inference_context, inference_params)
        if context is None:
            return super().forward(
                hidden_states, attention_mask, key_value_states, None, *args, **megatron_kwargs
            )
        if not context.is_static_batching():
            raise NotImplementedError(
                "MEA with Megatron's dynamic (paged) inference context is not supported yet "
                "(docs/inference-decode.md); use the static context"
            )
        if args:
            raise ValueError("MEA inference takes Megatron's attention arguments by keyword")
        unsupported = ("packed_seq_params", "attention_bias")
        if key_value_states is not None or any(megatron_kwargs.get(k) is not None
                                               for k in unsupported):
            raise ValueError(
                "MEA inference takes self-attention over unpacked sequences, without "
                "key_value_states, packed_seq_params or attention_bias"
            )
        return self._forward_with_cache(
            hidden_states, attention_mask, context, megatron_kwargs.get("rotary_pos_emb")
        )

    def _rope(self, x, freqs):
        if freqs is None:
            return x
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        return apply_rotary_pos_emb(
            x, freqs, config=self.config, mscale=mscale, cp_group=self.pg_collection.cp
        )

    def _position_freqs(self, rotary_pos_emb, start, length):
        """RoPE frequencies `(query, key)` of positions `[start, start + length)`, or None."""
        no_rope = self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]
        if rotary_pos_emb is None or no_rope:
            return None, None
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        return tuple(f[start : start + length] for f in rotary_pos_emb)

    def _cache_entries(self, key, value, composite_key, composite_value, key_freqs):
        """What the cache stores for the new tokens: keys, values `[s, b, n, hn]` and the key
        scales `[s, b, ng_loc]` (or None)."""
        if self.cache_kind is CacheKind.COMPOSITES:
            return self._rope(self._norm_key(composite_key), key_freqs), composite_value, None
        if self.cache_kind is CacheKind.COMPONENTS:
            return self._rope(key, key_freqs), value, None
        factors = self.key_norm_factors
        key_scales = inverse_rms(composite_key, factors.eps_for(key.dtype))
        if factors.scale is not None:
            # Elementwise, shared by all heads: commutes with HLC.
            key = key * factors.scale.to(key.dtype)
        return self._rope(key, key_freqs), value, key_scales

    def _query_side_mix(self):
        """HLC for `attend` over a cache of components; None over composites (always the case
        without HLC, the +norm control: components are the composites)."""
        if not self.cache_kind.holds_components:
            return None
        mix = self.head_mix
        return QuerySideMix(
            mix.key_weight, mix.value_weight, self.tp_group, self.components_sharded
        )

    def _forward_with_cache(self, hidden_states, attention_mask, context, rotary_pos_emb):
        """Prefill (offset 0): composite attention over the prompt through `core_attention`;
        decode (offset > 0): attention over the cache, components mixed on the query side.
        Both write the new tokens' entries into the layer's cache first."""
        s, b = hidden_states.shape[:2]
        start, end = context.sequence_len_offset, context.sequence_len_offset + s
        if end > context.max_sequence_length:
            raise ValueError(
                f"position {end} is past the inference context's max_sequence_length "
                f"({context.max_sequence_length})"
            )
        batch = slice(context.batch_size_offset, context.batch_size_offset + b)
        query_freqs, key_freqs = self._position_freqs(rotary_pos_emb, start, s)
        query, key, value = self._project_components(hidden_states)
        key = self._norm_component_key(key)
        query = self._rope(self._norm_query(query), query_freqs)
        composite_key = composite_value = None
        if start == 0 or self.cache_kind is not CacheKind.COMPONENTS:
            composite_key, composite_value = self.mix_heads(key, value)  # the new tokens only
        if self.cache_kind is CacheKind.COMPOSITES:
            self._warn_composite_cache()
        entries = self._cache_entries(key, value, composite_key, composite_value, key_freqs)
        num_scales = entries[2].shape[2] if entries[2] is not None else 0
        cache = MEAKVCache.of(
            context, self.layer_number, self.cache_kind, entries[0].shape[2],
            self.hidden_size_per_attention_head, num_scales, like=key,
        )
        cache.write(start, batch, *entries)
        if start == 0:
            if self.cache_kind is CacheKind.COMPOSITES:
                composite_key = entries[0]  # normed and RoPE'd already
            else:
                composite_key = self._rope(self._norm_key(composite_key), key_freqs)
            core = self.core_attention(
                query, composite_key, composite_value, attention_mask,
                attn_mask_type=self.attn_mask_type, attention_bias=None, packed_seq_params=None,
            )
        else:
            mask = attention_mask
            if mask is None:  # causal among the new tokens (Megatron's static engine may pass one)
                mask = decode_mask(s, end, query.device)
            scale = self.config.softmax_scale or self.hidden_size_per_attention_head**-0.5
            step = DecodeStep(query.transpose(0, 1), end, batch, mask, scale)
            out = attend(cache, step, self._query_side_mix())
            core = out.transpose(0, 1).reshape(s, b, -1)
        return self.linear_proj(core)
