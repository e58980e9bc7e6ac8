"""MEA head-level group norm: RMSNorm of each query head's attention output, sharded by heads,
and the output projection that runs it (`head_normed`)."""

import functools

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide, get_pg_size

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
    dynamic, checkpointed, packed), so MEA with the head norm builds `linear_proj` from
    `head_normed(<the spec's row-parallel linear>)`: the same module, parameters and state-dict
    keys (`linear_proj.weight`, TE's extra state), whose forward norms its input first. The
    norm is the attention's own submodule (`head_norm.weight` in the checkpoint, sharded by
    heads); `use_head_norm` gives the projection a plain reference to it, so that no parameter is
    registered twice.
    """

    def use_head_norm(self, head_norm: HeadRMSNorm) -> None:
        object.__setattr__(self, "head_norm", head_norm)  # a reference, not a submodule

    def forward(self, core_attn_out: torch.Tensor, *args, **kwargs):
        """`[s, b, np_loc*hn]` -> the projection's `(output [s, b, h], bias)`."""
        return super().forward(self.head_norm(core_attn_out), *args, **kwargs)


@functools.cache
def head_normed(linear_class: type) -> type:
    """`linear_class` (Megatron's or TE's row-parallel linear) with `HeadNormedInput` first."""
    name = f"HeadNormed{linear_class.__name__}"
    return type(name, (HeadNormedInput, linear_class), {"__module__": __name__})
