"""KHA: a shared `hn x hn` transform (linear, gated MLP or gate) applied to every head of one
kind."""

import torch

from megatron_mea.ops import (
    KHA_MATRICES,
    fold_kha_linear,
    fuse_qkv,
    kha_init,
    kha_transform,
    rows_with_bias,
    split_bias,
    unfuse_qkv,
)
from megatron_mea.parallel import tp_replicated


def require_knock(attention: str, submodules) -> None:
    """Refuse `submodules` without a knock module before `attention` (a KHA self-attention class
    name, whose submodules class is `<attention>Submodules`) builds anything of Megatron's."""
    if getattr(submodules, "knock", None) is None:
        raise TypeError(
            f"{attention} takes {attention}Submodules with a knock module, got "
            f"{type(submodules).__name__}: build its spec with megatron_mea.specs"
        )


class KnockingHeads(torch.nn.Module):
    """Knocking-heads transforms of Q/K/V, per head along the feature axis (docs/math.md).

    Parameters (all `[hn, hn]`, TP-replicated; every forward routes them through `tp_replicated`,
    so their gradients, partial over each rank's heads, are summed over the TP group), for each
    target `t` of `kha_targets`:
        linear variant: `t_weight` (`x @ T`);
        mlp variant: `t_up`, `t_gate`, `t_down`;
        gate variant: `t_gate`.
    Initial values (`kha_init`, `ops.functional.kha_init`): identity matrices and zero gates (the
    layer starts as the baseline), or N(0, 1/hn) draws from the default torch generator, seeded
    alike on every TP rank so that the replicas start identical.

    Args:
        config: an `MEATransformerConfig` with attention_variant="kha".
        tp_group: the tensor-parallel process group.
    """

    def __init__(self, config, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.variant = config.kha_variant
        self.targets = tuple(config.kha_targets)
        hn = self.head_dim = config.kv_channels
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for target in self.targets:
            for name, init in kha_init(self.variant, hn, config.kha_init).items():
                param = torch.nn.Parameter(init.to(device=device, dtype=config.params_dtype))
                self.register_parameter(f"{target}_{name}", param)

    def _weight(self, name: str) -> torch.Tensor:
        return tp_replicated(getattr(self, name), self.tp_group)

    def forward(self, query, key, value):
        """Transform `query [s, b, np_loc, hn]`, `key, value [s, b, ng_loc, hn]` (shapes kept)."""
        heads = {"q": query, "k": key, "v": value}
        for target in self.targets:
            matrices = (self._weight(f"{target}_{m}") for m in KHA_MATRICES[self.variant])
            heads[target] = kha_transform(heads[target], self.variant, *matrices)
        return heads["q"], heads["k"], heads["v"]

    def fold(self, weight: torch.Tensor, bias, num_heads: int, num_groups: int):
        """KHA-Linear folded into this rank's `linear_qkv` rows: `W_h' = T^T W_h` per head.

        Args:
            weight: `linear_qkv.weight` `[ng_loc * (np_loc/ng_loc + 2) * hn, h]`, interleaved per
                K/V group as `q.. k v`.
            bias: its bias `[rows]`, or None.
            num_heads, num_groups: np_loc and ng_loc, this rank's query heads and K/V groups.

        Returns:
            weight (same shape) and bias (or None): projecting with them equals projecting with
            the originals and then applying `kha_linear` to the targeted heads.
        """
        hn = self.head_dim
        rows = rows_with_bias(weight, bias)
        wide = torch.promote_types(weight.dtype, torch.float32)  # fold in fp32, as HLC's
        parts = dict(zip("qkv", unfuse_qkv(rows, num_heads, num_groups, hn)))
        for target in self.targets:
            transform = tp_replicated(getattr(self, f"{target}_weight"), self.tp_group)
            folded = fold_kha_linear(parts[target].to(wide), transform.to(wide))
            parts[target] = folded.to(weight.dtype)
        return split_bias(fuse_qkv(parts["q"], parts["k"], parts["v"]), bias is not None)
