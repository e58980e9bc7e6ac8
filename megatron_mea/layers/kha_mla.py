"""KHA-Linear on Megatron-Core's multi-latent attention (MLA, DeepSeek-V2/V3 style).

MLA builds each head from shared low-rank latents: the up-projections `linear_q_up_proj` (or
`linear_q_proj` without a query latent) and `linear_kv_up_proj` produce per-head queries
`[q_c | q_r]` and per-head `[k_c | v]`; the key's RoPE part `k_r` is one head shared by all heads,
split off `linear_kv_down_proj`. RoPE rotates only the `q_r` / `k_r` channels ("decoupled RoPE").

Placement: after the up-projections (as in the KHA paper), on the *content* channels only:

    q_c <- q_c @ T_q    k_c <- k_c @ T_k    v <- v @ T_v    (q_r, k_r unchanged)

with `T_q, T_k` of size `qk_head_dim` and `T_v` of size `v_head_dim`, each shared by all heads and
identity at init (`kha_targets` picks which exist). The paper's q/k matrices also span the
`qk_pos_emb_head_dim` RoPE channels; they are left out here because every way of including them
breaks what decoupled RoPE is for:
- after RoPE, a matrix that mixes rotated channels with content channels (or rotated channels of
  different frequencies) makes the logits depend on absolute positions, not only on distances;
- before RoPE, `k_r @ T` is fine but the content-to-RoPE block gives every head its own rotated
  key, so the single shared `k_r` (what MLA caches next to the latent) is gone, and neither that
  block nor the post-RoPE form folds into MLA's weights.
On the content channels RoPE never acts, so applying the matrices after Megatron has assembled the
rotated heads equals applying them right after the up-projections, and each matrix folds exactly
into the rows of its up-projection (`W_h' = T^T W_h` per head): MLA's latent KV cache and its
absorbed decoding stay valid for the folded model. The override below therefore calls Megatron's
own `get_query_key_value_tensors` (every RoPE / YaRN / fusion / packing path included) and then
transforms the content channels, so no Megatron code is copied.

KHA-MLP, MEA, `kha_fold_linear`, `cache_mla_latents` and TP > 1 without sequence parallelism
are refused on MLA by `MEATransformerConfig`, which says why. On the local (non-TE) spec, MLA
needs `MLASDPADotProductAttention` and duplicated down-projections (`megatron_mea/specs.py`).

Shape legend: `s` sequence (full, also under SP), `b` batch (packed `thd` inputs have no `b`),
`np_loc` this rank's heads, `dc` = qk_head_dim, `dr` = qk_pos_emb_head_dim, `dv` = v_head_dim.
"""

from dataclasses import dataclass
from typing import Union

import torch
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_mea.config import MEATransformerConfig
from megatron_mea.layers.knock import require_knock
from megatron_mea.layers.sdpa_attention import SDPADotProductAttention
from megatron_mea.ops import kha_linear
from megatron_mea.parallel import tp_replicated


@dataclass
class MEAMLATransformerConfig(MLATransformerConfig, MEATransformerConfig):
    """Megatron's `MLATransformerConfig` (its MLA fields and defaults, `multi_latent_attention`
    True) with the MEA / KHA fields and checks of `MEATransformerConfig`; on MLA only
    `attention_variant='kha'` with `kha_variant='linear'` is accepted."""


class MLASDPADotProductAttention(SDPADotProductAttention):
    """`SDPADotProductAttention` as MLA's core attention on the local (non-TE) spec.

    MLA's query/key heads (`dc + dr`) and value heads (`dv`) differ in size, which it passes as
    `k_channels` / `v_channels`; Megatron's local `DotProductAttention` takes neither (both
    releases), so only the TE spec builds MLA in Megatron. torch's kernel reads the sizes from the
    tensors: query, key `[s, b, np_loc, dc + dr]`, value `[s, b, np_loc, dv]` ->
    `[s, b, np_loc * dv]`. Softmax scale: MLA's (YaRN mscale included).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        kwargs.pop("k_channels", None)
        kwargs.pop("v_channels", None)
        super().__init__(config, layer_number, attn_mask_type, attention_type, *args, **kwargs)


class MLAKnockingHeads(torch.nn.Module):
    """KHA-Linear for MLA heads: shared, identity-initialised matrices on the content channels.

    Parameters (TP-replicated: every rank holds the whole matrix; each forward routes it through
    `tp_replicated`, so its gradient, partial over this rank's heads, is summed over the TP group
    before DDP sees it; no `tensor_model_parallel` axis, so checkpoints store one copy):
        q_weight, k_weight: `[dc, dc]`; v_weight: `[dv, dv]`; those of `config.kha_targets`.

    Args:
        config: an MLA config with attention_variant="kha" and kha_variant="linear".
        tp_group: the tensor-parallel process group.
    """

    def __init__(self, config, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.targets = tuple(config.kha_targets)
        self.content_dim = config.qk_head_dim
        sizes = {"q": config.qk_head_dim, "k": config.qk_head_dim, "v": config.v_head_dim}
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for target in self.targets:
            init = torch.eye(sizes[target], device=device, dtype=config.params_dtype)
            self.register_parameter(f"{target}_weight", torch.nn.Parameter(init))

    def _transform_content(self, heads, name):
        """`heads [..., np_loc, dc + dr]` with its first `dc` channels multiplied by `name`."""
        weight = tp_replicated(getattr(self, name), self.tp_group)
        content, rope = heads.split([self.content_dim, heads.shape[-1] - self.content_dim], -1)
        return torch.cat([kha_linear(content, weight), rope], dim=-1)

    def forward(self, query, key, value):
        """Transform query, key `[..., np_loc, dc + dr]` and value `[..., np_loc, dv]` (shapes
        kept; the RoPE channels `dr` pass through)."""
        if "q" in self.targets:
            query = self._transform_content(query, "q_weight")
        if "k" in self.targets:
            key = self._transform_content(key, "k_weight")
        if "v" in self.targets:
            value = kha_linear(value, tp_replicated(self.v_weight, self.tp_group))
        return query, key, value


@dataclass
class KHAMLASelfAttentionSubmodules(MLASelfAttentionSubmodules):
    """Megatron's MLA submodules plus KHA's transforms, as the spec builds them
    (`megatron_mea.specs`).

    Args:
        knock: the content-channel transforms (`MLAKnockingHeads`), built with `(config,
            tp_group)`.
    """

    knock: Union[ModuleSpec, type, None] = None


class KHAMLASelfAttention(MLASelfAttention):
    """Megatron's `MLASelfAttention` with KHA-Linear (`knock`) on the up-projected heads.

    Keeps every submodule, state-dict name and tensor-parallel layout of `MLASelfAttention`; the
    new parameters live in the child module `knock` (its `KHAMLASelfAttentionSubmodules` field,
    an `MLAKnockingHeads`)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        # args / kwargs: Megatron's own (attn_mask_type, cp_comm_type, pg_collection, and in
        # newer releases pp_layer_offset, name), passed through unchanged.
        require_knock("KHAMLASelfAttention", submodules)
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.knock = build_module(submodules.knock, config, self.tp_group)

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        """Megatron's MLA projections and RoPE, then KHA on the content channels.

        Args and the returned tuple are Megatron's (they differ slightly between releases):
        `hidden_states [s(/tp under SP), b, h]` -> query, key `[s, b, np_loc, dc + dr]`, value
        `[s, b, np_loc, dv]` (RoPE applied to the last `dr` channels of q and k), and the
        compressed q / kv latents.
        """
        query, key, value, *latents = super().get_query_key_value_tensors(
            hidden_states, *args, **kwargs
        )
        query, key, value = self.knock(query, key, value)
        return (query, key, value, *latents)
