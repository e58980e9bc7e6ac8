"""MEA head-level linear composition (HLC) of K and V across heads, tensor-parallel.

Shape legend: `s` sequence, `b` batch, `nc` component heads, `ng` composite heads, `hn` head dim,
`t` TP size; `_loc` = this rank's share (`nc/t`, `ng/t`). Tokens are `N = s*b`.
"""

import torch
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from megatron_mea.ops import (
    fold_head_mix,
    fuse_qkv,
    head_mix,
    mix_init,
    rows_with_bias,
    split_bias,
    unfuse_qkv,
)
from megatron_mea.parallel import gather_rows, heads_to_tokens, tokens_to_heads, tp_replicated


class HeadMix(torch.nn.Module):
    """Composite K/V heads as learned combinations of the component heads (docs/math.md).

    Parameters (TP-replicated; every forward routes them through `tp_replicated`, so their
    gradients are summed over the TP group before any optimizer or DDP sees them):
        key_weight, value_weight: `A_k`, `A_v`, `[nc, ng]`, component -> composite.

    Under TP each rank holds only `nc/t` component heads but every composite head needs all of
    them, so the `activations` exchange trades the head shard for a token shard with one
    all-to-all (K and V together), mixes with the full matrices, and trades back. With fewer
    components than ranks (`nc < t`) every rank holds all of them (duplicated) and expands to its
    own `ng/t` composite heads with its columns of the matrices; no exchange.

    The `weights` exchange (`fold`) mixes the projection rows instead of the activations: gather
    the K/V rows of `linear_qkv` over TP, fold them with this rank's columns of the matrices, and
    project with the resulting plain-GQA weight; the gather's backward reduce-scatters.

    Args:
        config: an `MEATransformerConfig` with attention_variant="mea".
        tp_group: the tensor-parallel process group.
        num_components: this layer's `nc` (`config.kv_components(layer_number)`).
    """

    def __init__(self, config, tp_group, num_components):
        super().__init__()
        self.tp_group = tp_group
        self.num_components = num_components
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()

        def make():
            # Default torch generator, seeded alike on every TP rank: replicas start identical.
            init = mix_init(config.mea_mix_init, self.num_components, self.num_groups)
            return torch.nn.Parameter(init.to(device=device, dtype=config.params_dtype))

        self.key_weight = make()
        self.value_weight = make()
        self.world_size, self.rank = get_pg_size(tp_group), get_pg_rank(tp_group)
        self.duplicated = self.num_components < self.world_size
        self.groups_per_rank = divide(self.num_groups, self.world_size)
        start = self.rank * self.groups_per_rank
        self.local_groups = slice(start, start + self.groups_per_rank)

    def forward(self, key: torch.Tensor, value: torch.Tensor):
        """Mix component heads into composite heads.

        Args:
            key, value: component heads `[s, b, nc_loc, hn]` (all `nc` when duplicated).

        Returns:
            key, value: composite heads `[s, b, ng_loc, hn]`.
        """
        key_weight = tp_replicated(self.key_weight, self.tp_group)
        value_weight = tp_replicated(self.value_weight, self.tp_group)
        if self.duplicated:
            key_weight = key_weight[:, self.local_groups]
            value_weight = value_weight[:, self.local_groups]
        if self.duplicated or self.world_size == 1:
            # Contiguous [s, b, ng, hn], as the core attention views (b, heads) as one dim.
            key = head_mix(key, key_weight).contiguous()
            return key, head_mix(value, value_weight).contiguous()

        # K and V travel in one collective, interleaved per head ([.., head, kv, hn]) so that the
        # returned key/value views keep (b, heads) mergeable without a copy.
        s, b = key.shape[:2]
        world = self.world_size
        kv = torch.stack([key, value], dim=-2).view(s * b, -1)  # [N, nc_loc*2*hn]
        kv = heads_to_tokens(kv, self.tp_group)  # [t_src, n_r, nc_loc*2*hn]
        shard = kv.shape[1]
        kv = kv.view(world, shard, key.shape[2], 2, self.head_dim)  # shard may be 0 tokens
        # HLC (ops.head_mix) with the component axis split as (source rank, local component) and
        # the composite axis as (destination rank, local composite): the einsum reads the
        # received buffer and writes the send buffer, with no permute materialised around it.
        mix = torch.stack([key_weight, value_weight])  # [2, nc, ng]
        mix = mix.view(2, world, -1, world, self.groups_per_rank)
        kv = torch.einsum("rnjkd,krjeh->enhkd", kv, mix)  # [t_dst, n_r, ng_loc, 2, hn]
        features = self.groups_per_rank * 2 * self.head_dim
        kv = tokens_to_heads(kv.contiguous().view(world, shard, features), self.tp_group, s * b)
        kv = kv.view(s, b, -1, 2, self.head_dim)  # [s, b, ng_loc, 2, hn]
        return kv[..., 0, :], kv[..., 1, :]

    def fold(self, weight: torch.Tensor, bias, num_heads: int):
        """The `weights` exchange: this rank's `linear_qkv` weight with HLC folded in.

        Args:
            weight: this rank's component `linear_qkv.weight`: `[nc_loc * (np/nc + 2) * hn, h]`,
                rows interleaved per component group as `q.. k v` (all `nc` groups spread
                evenly over the ranks by rows when duplicated).
            bias: its bias `[rows]`, or None.
            num_heads: np, the global query head count.

        Returns:
            weight `[ng_loc * (np/ng + 2) * hn, h]` and bias (or None), laid out as Megatron's
            plain GQA `linear_qkv` with `ng` groups, so the usual split yields composite K/V.
        """
        hn, nc = self.head_dim, self.num_components
        rows = rows_with_bias(weight, bias)
        if self.duplicated:
            # Rows are split evenly, not by group: gather all of them, keep our query heads.
            query, key, value = unfuse_qkv(gather_rows(rows, self.tp_group), num_heads, nc, hn)
            local_heads = num_heads // self.world_size
            query = query.narrow(0, self.rank * local_heads, local_heads)
        else:
            heads = divide(num_heads, self.world_size)
            query, key, value = unfuse_qkv(rows, heads, divide(nc, self.world_size), hn)
            if self.world_size > 1:
                # K and V rows of every rank in one collective: [nc, 2, hn, columns]. (A single
                # rank holds them all already; stacking would only copy them, fwd and bwd.)
                kv = gather_rows(torch.stack([key, value], dim=1), self.tp_group)
                key, value = kv[:, 0], kv[:, 1]
        key_weight = tp_replicated(self.key_weight, self.tp_group)[:, self.local_groups]
        value_weight = tp_replicated(self.value_weight, self.tp_group)[:, self.local_groups]
        # Fold in fp32 (a bf16 fold would round every composite row once more than mixing does).
        wide = torch.promote_types(weight.dtype, torch.float32)
        key = fold_head_mix(key.to(wide), key_weight.to(wide))  # [ng_loc, hn, columns]
        value = fold_head_mix(value.to(wide), value_weight.to(wide))
        # np_loc/ng_loc query heads per composite group: Megatron's plain GQA layout.
        folded = fuse_qkv(query, key.to(weight.dtype), value.to(weight.dtype))
        return split_bias(folded, bias is not None)
