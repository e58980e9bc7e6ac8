"""KHA self-attention, and the split-explicit `SelfAttention` both variants build on (MEA's
class is in `mea_attention.py`).

Both keep Megatron's submodules (`linear_qkv`, `core_attention`, `linear_proj`, q/k norms), their
state-dict names and their tensor-parallel layout; the new parameters live in child modules
`head_mix`, `head_norm` (MEA) and `knock` (KHA).

Shape legend: `s` sequence (full, also under SP: `linear_qkv` gathers it), `b` batch, `np_loc`
local query heads, `nc_loc` / `ng_loc` local component / composite K/V heads, `hn` head dim.
"""

import dataclasses
from typing import Union

import torch
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_mea.layers.knock import require_knock
from megatron_mea.ops.qkv_layout import unfuse_qkv


def _built_by_split_attention(**megatron_kwargs):
    """The core attention Megatron's `Attention.__init__` builds: none, `_SplitSelfAttention`
    builds it after."""
    return None


class _SplitSelfAttention(SelfAttention):
    """`SelfAttention` whose q/k/v split is explicit, so the variants can act between the split
    and the q/k norms (`ops/qkv_layout.py` holds Megatron's row layout). `MEATransformerConfig`
    guarantees what this split relies on: no fused qkv-rope (Megatron's forward always splits),
    no output gate, and `num_query_groups % tp == 0`.

    Folded projections (MEA's `weights` exchange, KHA-Linear with `kha_fold_linear`) run
    Megatron's own `linear_qkv` module (SP gather, TE, FP8 and all) with a weight computed from
    its parameters and the variant's matrices; `fold_cache` (set by `enable_fold_cache`) builds
    that weight once per optimizer step."""

    fold_cache = None  # a FoldCache (layers/fold_cache.py), set by enable_fold_cache
    folds_projection = False  # this layer may run linear_qkv with a folded weight

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type=AttnMaskType.padding,
        cp_comm_type=None,
        pg_collection=None,
        *,
        projection_config=None,
        **megatron_kwargs,
    ):
        """Megatron's `SelfAttention.__init__`, with the config its submodules are sized from
        given apart.

        Args:
            config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection:
                as Megatron's `SelfAttention`.
            projection_config: the config Megatron's `__init__` builds `linear_qkv` (and the
                other submodules but the core attention) from; `self.config` is `config`
                afterwards. Default: `config`.
            megatron_kwargs: what newer Megatron-Core layers also pass (`name`,
                `pp_layer_offset`).
        """
        # Megatron's __init__ would build the core attention from the projection's config (MEA:
        # nc groups); it is built once below, from `config`, instead.
        super().__init__(
            config if projection_config is None else projection_config,
            dataclasses.replace(submodules, core_attention=_built_by_split_attention),
            layer_number,
            attn_mask_type,
            cp_comm_type,
            pg_collection,
            **megatron_kwargs,
        )
        self.config = config
        self.cp_comm_type = cp_comm_type  # Megatron keeps it only inside the core attention
        self.core_attention = submodules.core_attention(
            config=config,
            layer_number=self.layer_number,
            attn_mask_type=self.attn_mask_type,
            attention_type=self.attention_type,
            cp_comm_type=cp_comm_type,
            softmax_scale=config.softmax_scale,
            pg_collection=self.pg_collection,
        )

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
        heads, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        return unfuse_qkv(mixed_qkv, heads, num_groups, hn, dim=-1)

    def _project_and_split(self, hidden_states, key_value_states):
        if key_value_states is not None:
            raise ValueError("the MEA / KHA variants are self-attention only")
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        heads, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        return unfuse_qkv(mixed_qkv, heads, groups, hn, dim=-1)


@dataclasses.dataclass
class KHASelfAttentionSubmodules(SelfAttentionSubmodules):
    """Megatron's self-attention submodules plus KHA's transforms, as the spec builds them
    (`megatron_mea.specs`).

    Args:
        knock: the Q/K/V transforms (`KnockingHeads`), built with `(config, tp_group)`.
    """

    knock: Union[ModuleSpec, type, None] = None


class KHASelfAttention(_SplitSelfAttention):
    """Knocking-heads attention: `knock` transforms Q/K/V right after the split, before the q/k
    norms and RoPE (so KHA-Linear folds into `linear_qkv`)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        """Arguments as `_SplitSelfAttention`'s (Megatron's `SelfAttention`); `submodules` a
        `KHASelfAttentionSubmodules`."""
        require_knock("KHASelfAttention", submodules)
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.knock = build_module(submodules.knock, config, self.tp_group)
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
