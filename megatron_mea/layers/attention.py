"""MEA and KHA self-attention: Megatron's `SelfAttention` with the variants' transforms.

Both keep Megatron's submodules (`linear_qkv`, `core_attention`, `linear_proj`, q/k norms), their
state-dict names and their tensor-parallel layout; the new parameters live in child modules
`head_mix`, `head_norm` (MEA) and `knock` (KHA).

Shape legend: `s` sequence (full, also under SP: `linear_qkv` gathers it), `b` batch, `np_loc`
local query heads, `nc_loc` / `ng_loc` local component / composite K/V heads, `hn` head dim.
"""

import copy

import torch
from megatron.core.inference.contexts import BaseInferenceContext
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import deprecate_inference_params, divide, get_pg_rank

from megatron_mea.layers.head_mix import HeadMix
from megatron_mea.layers.head_norm import HeadRMSNorm
from megatron_mea.layers.knock import KnockingHeads
from megatron_mea.parallel import ExchangeShape, choose_exchange, gather_features


def split_qkv(mixed_qkv: torch.Tensor, num_groups: int, num_heads: int, head_dim: int):
    """Split `linear_qkv`'s output, laid out per K/V group as `q ... q k v` (Megatron's layout).

    Args:
        mixed_qkv: `[s, b, num_groups * (num_heads/num_groups + 2) * hn]`.
        num_groups, num_heads: local K/V groups and query heads.
        head_dim: hn.

    Returns:
        query `[s, b, num_heads, hn]`, key and value `[s, b, num_groups, hn]` (views).
    """
    per_group = num_heads // num_groups
    mixed = mixed_qkv.view(*mixed_qkv.shape[:-1], num_groups, (per_group + 2) * head_dim)
    query, key, value = torch.split(mixed, [per_group * head_dim, head_dim, head_dim], dim=-1)
    return query.reshape(*query.shape[:-2], num_heads, head_dim), key, value


class _SplitSelfAttention(SelfAttention):
    """`SelfAttention` whose q/k/v split is explicit, so the variants can act between the split
    and the q/k norms. `MEATransformerConfig` guarantees what this split relies on: no fused
    qkv-rope (split_qkv is always True), no output gate, and `num_query_groups % tp == 0`.

    Folded projections (MEA's `weights` exchange, KHA-Linear with `kha_fold_linear`) run
    Megatron's own `linear_qkv` module (SP gather, TE, FP8 and all) with a weight computed from
    its parameters and the variant's matrices; `fold_cache` (set by `enable_fold_cache`) builds
    that weight once per optimizer step."""

    fold_cache = None  # a FoldCache (layers/fold_cache.py), set by enable_fold_cache
    folds_projection = False  # this layer may run linear_qkv with a folded weight

    def _enable_folded_projection(self):
        self.folds_projection = True
        # The folded weight is a computed tensor without `main_grad`: its weight gradient must
        # come back through autograd (and the fold) rather than being fused into the parameter's
        # main_grad by the GEMM. DDP's hooks add the resulting `.grad` as usual.
        self.linear_qkv.gradient_accumulation_fusion = False  # Megatron's local linear
        if hasattr(self.linear_qkv, "fuse_wgrad_accumulation"):
            self.linear_qkv.fuse_wgrad_accumulation = False  # Transformer Engine
        if hasattr(self.linear_qkv, "disable_parameter_transpose_cache"):
            # TE caches the FP8 copy of the weight per module between micro-batches; the folded
            # weight is a different tensor (and MEA's `auto` may alternate), so quantise the
            # weight handed in at every call.
            self.linear_qkv.disable_parameter_transpose_cache = True

    def _qkv_bias(self):
        bias = getattr(self.linear_qkv, "bias", None)  # TE keeps an empty tensor when unused
        return bias if isinstance(bias, torch.Tensor) and bias.numel() else None

    def _project_folded(self, hidden_states, key_value_states, fold, matrices, num_groups):
        """`linear_qkv` run with the weight (and bias) `fold(weight, bias)` computes from its
        own parameters and the variant's `matrices`.

        Returns query `[s, b, np_loc, hn]`, key and value `[s, b, num_groups, hn]`."""
        if key_value_states is not None:
            raise ValueError("the MEA / KHA variants are self-attention only")
        weight, bias = self.linear_qkv.weight, self._qkv_bias()
        if self.fold_cache is not None and torch.is_grad_enabled():
            params = [weight, *matrices] + ([] if bias is None else [bias])
            weight, bias = self.fold_cache.get(lambda: fold(weight, bias), params)
        else:
            weight, bias = fold(weight, bias)
        tensors = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
        mixed_qkv, _ = torch.func.functional_call(self.linear_qkv, tensors, (hidden_states,))
        return split_qkv(
            mixed_qkv,
            num_groups,
            self.num_attention_heads_per_partition,
            self.hidden_size_per_attention_head,
        )

    def _project_and_split(self, hidden_states, key_value_states):
        if key_value_states is not None:
            raise ValueError("the MEA / KHA variants are self-attention only")
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        return split_qkv(
            mixed_qkv,
            self.num_query_groups_per_partition,
            self.num_attention_heads_per_partition,
            self.hidden_size_per_attention_head,
        )


class KHASelfAttention(_SplitSelfAttention):
    """Knocking-heads attention: `knock` transforms Q/K/V right after the split, before the q/k
    norms and RoPE (so KHA-Linear folds into `linear_qkv`)."""

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type=AttnMaskType.padding,
        cp_comm_type=None,
        pg_collection=None,
        **megatron_kwargs,
    ):
        # megatron_kwargs: what newer Megatron-Core layers also pass (`name`, `pp_layer_offset`).
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type,
            cp_comm_type,
            pg_collection,
            **megatron_kwargs,
        )
        self.knock = KnockingHeads(config, self.tp_group)
        if config.kha_fold_linear:
            self._enable_folded_projection()

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """`[s, b, h]` -> query `[s, b, np_loc, hn]`, key, value `[s, b, ng_loc, hn]`."""
        if self.folds_projection:
            # KHA-Linear folded into the rows of linear_qkv (`T^T W` per head).
            heads = self.num_attention_heads_per_partition
            groups = self.num_query_groups_per_partition
            query, key, value = self._project_folded(
                hidden_states,
                key_value_states,
                lambda weight, bias: self.knock.fold(weight, bias, heads, groups),
                list(self.knock.parameters()),
                groups,
            )
        else:
            query, key, value = self._project_and_split(hidden_states, key_value_states)
            query, key, value = self.knock(query, key, value)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


class MEASelfAttention(_SplitSelfAttention):
    """Multi-head explicit attention: HLC over K/V heads plus a per-head RMS norm of the output.

    `linear_qkv` produces `nc` component K/V heads (`mea_num_kv_components`); the KV cache stores
    them (pre-norm, pre-RoPE); `head_mix` rebuilds the `ng` composite heads right after the cache,
    then `k_layernorm`, RoPE and the unchanged core attention run on the composites. With
    `nc < ng` ("virtual heads") the projection and the cache shrink to `nc/ng` of GQA's.

    With fewer components than TP ranks (`nc < t`, e.g. 4 KV heads rebuilt from 2 at TP=4) the
    projection output is all-gathered, so every rank holds (and caches) all `nc` components,
    keeps its own `np/t` query heads and expands to its own composite heads.

    TP exchange (`mea_tp_exchange`, SPEC section 3), for training forwards; evaluation and
    decoding always take the component path, so the KV cache keeps its `nc/ng` size:
    - `activations`: project the components, mix the activations (`head_mix.forward`);
    - `weights`: fold HLC into the K/V rows (`head_mix.fold`) and run `linear_qkv` with the folded
      weight, which yields composite heads directly; with `enable_fold_cache` the fold is built
      once per optimizer step;
    - `auto`: per micro-batch, whichever sends fewer elements (`parallel/exchange.py`).
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type=AttnMaskType.padding,
        cp_comm_type=None,
        pg_collection=None,
        **megatron_kwargs,
    ):
        # Megatron sizes linear_qkv and the KV cache from num_query_groups: give it the component
        # count, then restore the real config for everything downstream of HLC.
        self.num_components = config.kv_components(layer_number)
        component_config = copy.copy(config)
        component_config.num_query_groups = self.num_components
        super().__init__(
            component_config,
            submodules,
            layer_number,
            attn_mask_type,
            cp_comm_type,
            pg_collection,
            **megatron_kwargs,
        )
        self.config = config
        self.components_duplicated = self.num_components < self.world_size
        if self.components_duplicated:
            # Megatron's "fewer groups than ranks" sizes assume one group and np/nc query heads
            # per rank; here each rank keeps np/t query heads and all nc components.
            self.num_attention_heads_per_partition = divide(
                config.num_attention_heads, self.world_size
            )
            self.num_query_groups_per_partition = self.num_components
        if self.num_components != config.num_query_groups:
            # The core attention sees ng composite groups (no parameters, so nothing is lost).
            self.core_attention = submodules.core_attention(
                config=config,
                layer_number=self.layer_number,
                attn_mask_type=self.attn_mask_type,
                attention_type=self.attention_type,
                cp_comm_type=cp_comm_type,
                softmax_scale=config.softmax_scale,
                pg_collection=self.pg_collection,
            )
        self.head_mix = HeadMix(config, self.tp_group, self.num_components)
        self.exchange = config.mea_tp_exchange
        bias = self._qkv_bias()
        self.exchange_shape = ExchangeShape(
            num_heads=config.num_attention_heads,
            num_groups=config.num_query_groups,
            num_components=self.num_components,
            head_dim=self.hidden_size_per_attention_head,
            hidden_size=config.hidden_size,
            tp_size=self.world_size,
            bias=bias is not None,
        )
        self._kv_composite = False  # this forward's K/V came out of a folded projection
        if self.exchange != "activations":
            self._enable_folded_projection()
        self.head_norm = HeadRMSNorm(config, self.tp_group) if config.mea_head_norm else None
        if self.head_norm is not None:
            # Attention.forward runs core attention (static, dynamic, checkpointed or packed
            # paths) and then linear_proj with no seam in between; linear_proj's input is the one
            # place every path shares. A pre-hook there is the only way to insert the norm
            # without copying Megatron's 300-line forward.
            self.linear_proj.register_forward_pre_hook(self._normalize_heads)

    def _use_folded_weight(self, hidden_states) -> bool:
        if self.exchange == "activations" or not self.training:
            return False
        if self.exchange == "weights" or (self.fold_cache is not None and self.fold_cache.live):
            return True
        tokens = hidden_states.shape[0] * hidden_states.shape[1]
        if self.config.sequence_parallel:
            tokens *= self.world_size  # linear_qkv gathers the sequence
        return choose_exchange(self.exchange_shape, tokens) == "weights"

    def _project_and_split(self, hidden_states, key_value_states):
        self._kv_composite = self._use_folded_weight(hidden_states)
        if self._kv_composite:
            # The `weights` exchange: HLC folded into the K/V rows; composite K/V come out.
            num_heads = self.config.num_attention_heads
            return self._project_folded(
                hidden_states,
                key_value_states,
                lambda weight, bias: self.head_mix.fold(weight, bias, num_heads),
                [self.head_mix.key_weight, self.head_mix.value_weight],
                self.config.num_query_groups // self.world_size,
            )
        if not self.components_duplicated:
            return super()._project_and_split(hidden_states, key_value_states)
        if key_value_states is not None:
            raise ValueError("the MEA / KHA variants are self-attention only")
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        # Every rank needs all nc components; the gather's backward sums the ranks' uses.
        mixed_qkv = gather_features(mixed_qkv, self.tp_group)
        query, key, value = split_qkv(
            mixed_qkv,
            self.num_components,
            self.config.num_attention_heads,
            self.hidden_size_per_attention_head,
        )
        heads = self.num_attention_heads_per_partition
        start = get_pg_rank(self.tp_group) * heads
        return query[:, :, start : start + heads], key, value

    def _normalize_heads(self, module, args):
        (core_attn_out,) = args
        return (self.head_norm(core_attn_out),)

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """`[s, b, h]` -> query `[s, b, np_loc, hn]` (q-normed), component key and value
        `[s, b, nc_loc, hn]` (HLC and the k norm come after the KV cache), or composite ones
        `[s, b, ng_loc, hn]` from a folded projection (then only the k norm follows)."""
        query, key, value = self._project_and_split(hidden_states, key_value_states)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        return query, key, value

    def _adjust_key_value_for_inference(
        self,
        inference_context: BaseInferenceContext,
        query,
        key,
        value,
        rotary_pos_emb,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """Cache the component heads (Megatron's static cache), then rebuild the composites.

        Megatron calls this on every forward, between the q/k/v split and RoPE; without an
        inference context it only passes the tensors through. Mixing here, for training too,
        keeps one code path: component key/value `[s, b, nc_loc, hn]` (or the cached prefix)
        -> composite `[s, b, ng_loc, hn]`, then `k_layernorm`.
        """
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None and not inference_context.is_static_batching():
            raise NotImplementedError(
                "MEA with Megatron's dynamic (paged) inference context is not supported yet "
                "(issue 6, 'Inference with MEA's compressed KV cache'); use the static context"
            )
        query, key, value, rotary_pos_emb, attn_mask_type, block_table = (
            super()._adjust_key_value_for_inference(
                inference_context,
                query,
                key,
                value,
                rotary_pos_emb,
                rotary_pos_cos,
                rotary_pos_sin,
                rotary_pos_cos_sin,
                sequence_len_offset,
            )
        )
        if not self._kv_composite:
            key, value = self.head_mix(key, value)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value, rotary_pos_emb, attn_mask_type, block_table
