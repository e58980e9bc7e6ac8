"""MEA head-level group norm: RMSNorm of each query head's attention output, sharded by heads,
and the output projections that run it (`head_normed_projection`)."""

import dataclasses
from typing import Union

import torch
from megatron.core.tensor_parallel.layers import (
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide, get_pg_size

from megatron_mea._optional import HAVE_TE
from megatron_mea.ops.fused import head_rms_norm_fused


class HeadRMSNorm(MegatronModule):
    """RMS-normalise every query head over its `hn` channels, with a learned per-channel scale.

    Parameters:
        weight: `[np/t * hn]`, init 1. TP-sharded along dim 0 like the heads themselves; each
            rank sees the full sequence of its own heads, so its gradient is complete locally (no
            TP reduction), and the checkpoint records it with tp axis 0.

    Args:
        config: an `MEATransformerConfig` (eps = layernorm_epsilon).
        tp_group: the tensor-parallel process group.
    """

    def __init__(self, config, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.num_heads = divide(config.num_attention_heads, get_pg_size(tp_group))
        self.head_dim = config.kv_channels
        self.eps = config.layernorm_epsilon
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.ones(self.num_heads * self.head_dim, device=device, dtype=config.params_dtype)
        )
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x [s, b, np_loc*hn]` (or `[t, 1, np_loc*hn]` packed) head by head."""
        heads = x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        weight = self.weight.view(self.num_heads, self.head_dim)
        return head_rms_norm_fused(heads, weight, self.eps).reshape(x.shape)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Declare `weight` as sharded along axis 0 over TP (a replicated entry would silently
        load rank 0's slice everywhere)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class HeadNormedInput:
    """The part of MEA's output projection that runs the head norm: `linear_proj(x) =
    projection(head_norm(x))`.

    Megatron's `Attention.forward` calls `self.linear_proj(core_attn_out)` on every path (static,
    dynamic, checkpointed, packed), so MEA with the head norm builds `linear_proj` as the spec's
    row-parallel linear with this class first (`head_normed_projection`): the same parameters
    and state-dict keys (`linear_proj.weight`, TE's extra state), with a forward that norms its
    input first. The norm is the attention's own submodule (its `head_norm` Submodules field,
    `head_norm.weight` in checkpoints, sharded by heads); `use_head_norm` hands the projection a
    plain reference to it, because registering it there too would add the key
    `linear_proj.head_norm.weight` that no checkpoint has.
    """

    def use_head_norm(self, head_norm: HeadRMSNorm) -> None:
        """Norm every input with `head_norm` (the attention's submodule) from now on."""
        # object.__setattr__: nn.Module's would register it as a submodule (a second key).
        object.__setattr__(self, "head_norm", head_norm)

    def forward(self, core_attn_out: torch.Tensor, *args, **kwargs):
        """`[s, b, np_loc*hn]` -> the projection's `(output [s, b, h], bias)`."""
        return super().forward(self.head_norm(core_attn_out), *args, **kwargs)


class HeadNormedRowParallelLinear(HeadNormedInput, RowParallelLinear):
    """MEA's `linear_proj` on the local spec: the head norm, then Megatron's `RowParallelLinear`."""


# Row-parallel linear of a Megatron spec -> the same linear with the head norm first.
HEAD_NORMED_PROJECTIONS = {RowParallelLinear: HeadNormedRowParallelLinear}

if HAVE_TE:
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    class HeadNormedTERowParallelLinear(HeadNormedInput, TERowParallelLinear):
        """MEA's `linear_proj` on the TE spec: the head norm, then `TERowParallelLinear`."""

    HEAD_NORMED_PROJECTIONS[TERowParallelLinear] = HeadNormedTERowParallelLinear


def head_normed_projection(linear_proj: Union[ModuleSpec, type]) -> Union[ModuleSpec, type]:
    """`linear_proj` (a spec's row-parallel linear, a class or a `ModuleSpec` of one) with the head
    norm first: its `HEAD_NORMED_PROJECTIONS` counterpart.

    Raises:
        ValueError: for a linear without one (a backend the plugin does not build MEA on).
    """
    module = linear_proj.module if isinstance(linear_proj, ModuleSpec) else linear_proj
    if module in HEAD_NORMED_PROJECTIONS.values():
        return linear_proj
    if module not in HEAD_NORMED_PROJECTIONS:
        name = getattr(module, "__name__", repr(module))
        known = ", ".join(cls.__name__ for cls in HEAD_NORMED_PROJECTIONS)
        raise ValueError(
            f"mea_head_norm=True runs the head norm inside linear_proj, which is known for "
            f"{known}, not for {name}; add its class to HEAD_NORMED_PROJECTIONS "
            "(megatron_mea/layers/head_norm.py) or set mea_head_norm=False"
        )
    if isinstance(linear_proj, ModuleSpec):
        return dataclasses.replace(linear_proj, module=HEAD_NORMED_PROJECTIONS[module])
    return HEAD_NORMED_PROJECTIONS[module]
