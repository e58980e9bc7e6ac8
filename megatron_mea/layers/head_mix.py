"""MEA head-level linear composition (HLC) of K and V across heads, tensor-parallel.

Shape legend: `s` sequence, `b` batch, `nc` component heads, `ng` composite heads, `hn` head dim,
`t` TP size; `_loc` = this rank's share (`nc/t`, `ng/t`). Tokens are `N = s*b`.
"""

import torch
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from megatron_mea.ops import head_mix, mix_init
from megatron_mea.parallel import heads_to_tokens, tokens_to_heads, tp_replicated


class HeadMix(torch.nn.Module):
    """Composite K/V heads as learned combinations of the component heads (SPEC section 1).

    Parameters (TP-replicated; every forward routes them through `tp_replicated`, so their
    gradients are summed over the TP group before any optimizer or DDP sees them):
        key_weight, value_weight: `A_k`, `A_v`, `[nc, ng]`, component -> composite.

    Under TP each rank holds only `nc/t` component heads but every composite head needs all of
    them, so the `activations` exchange trades the head shard for a token shard with one
    all-to-all (K and V together), mixes with the full matrices, and trades back. With fewer
    components than ranks (`nc < t`) every rank holds all of them (duplicated) and expands to its
    own `ng/t` composite heads with its columns of the matrices; no exchange.

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
        world = get_pg_size(tp_group)
        self.duplicated = self.num_components < world
        local = divide(self.num_groups, world)
        self.local_groups = slice(get_pg_rank(tp_group) * local, (get_pg_rank(tp_group) + 1) * local)

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
        if self.duplicated or get_pg_size(self.tp_group) == 1:
            # Contiguous [s, b, ng, hn], as the core attention views (b, heads) as one dim.
            key = head_mix(key, key_weight).contiguous()
            return key, head_mix(value, value_weight).contiguous()

        # K and V travel in one collective, interleaved per head ([.., head, kv, hn]) so that the
        # returned key/value views keep (b, heads) mergeable without a copy.
        s, b = key.shape[:2]
        kv = torch.stack([key, value], dim=-2).view(s * b, -1)  # [N, nc_loc*2*hn]
        kv = heads_to_tokens(kv, self.tp_group)  # [n_r, nc*2*hn]
        shard = kv.shape[0]
        kv = kv.view(shard, self.num_components, 2, self.head_dim).transpose(1, 2)
        kv = head_mix(kv, torch.stack([key_weight, value_weight]))  # [n_r, 2, ng, hn]
        kv = tokens_to_heads(kv.transpose(1, 2).reshape(shard, -1), self.tp_group, s * b)
        kv = kv.view(s, b, -1, 2, self.head_dim)  # [s, b, ng_loc, 2, hn]
        return kv[..., 0, :], kv[..., 1, :]
