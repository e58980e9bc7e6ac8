"""Collectives of the plugin, each an autograd-aware function of an explicit process group.

Shape legend: `N` tokens on this rank (`s*b`, the full sequence between `linear_qkv` and
`linear_proj`), `n_r` tokens in rank r's token shard, `f` features of the local heads
(`heads_local * ...`), `t` the group size.

Built on Megatron's own `all_to_all` (an all-to-all-v whose backward is the inverse exchange) and
all-gathers (backward reduce-scatter); `tp_replicated` has its own small autograd function (see
`_SumGradOverGroup` for why Megatron's copy-to-region is not used).
"""

from typing import List

import torch
from megatron.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    gather_from_sequence_parallel_region,
)


def token_split_sizes(num_tokens: int, world_size: int) -> List[int]:
    """Sizes of the contiguous token shards, as even as possible (earlier ranks take the rest)."""
    base, rest = divmod(num_tokens, world_size)
    return [base + (1 if r < rest else 0) for r in range(world_size)]


def heads_to_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Trade the head shard for a token shard: `[N, f]` -> `[t, n_r, f]`.

    Rank r ends with its token shard of every rank's features, source-rank-major (index 0 is the
    rank that held those heads: Megatron shards heads contiguously, so (source rank, local head)
    is the global head). No copy beyond the collective. Backward is the inverse exchange.
    """
    world, rank = group.size(), group.rank()
    num_tokens, features = x.shape
    sizes = token_split_sizes(num_tokens, world)
    received = all_to_all(group, x, [sizes[rank]] * world, sizes)  # [t * n_r, f]
    return received.view(world, sizes[rank], features)


def tokens_to_heads(y: torch.Tensor, group, num_tokens: int) -> torch.Tensor:
    """Inverse of `heads_to_tokens`: `[t, n_r, f]` (destination-rank-major: block d holds rank
    d's heads for my tokens) -> `[N, f]` (N = `num_tokens`)."""
    world, shard_tokens, features = y.shape
    sizes = token_split_sizes(num_tokens, world)
    send = y.reshape(world * shard_tokens, features)  # a view when y is contiguous
    return all_to_all(group, send, sizes, [shard_tokens] * world)


def gather_features(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim in rank order: `[..., f]` -> `[..., t*f]`.

    Backward reduce-scatters, so when every rank uses the whole gathered tensor (for different
    outputs) each shard's gradient is the sum of all the ranks' uses.
    """
    return all_gather_last_dim_from_tensor_parallel_region(x, group=group)


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the first dim in rank order: `[r, ...]` -> `[t*r, ...]`.

    Backward reduce-scatters (sums every rank's gradient for each shard, then keeps one's own):
    the `weights` exchange gathers projection rows this way and each rank folds all of them.
    """
    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (SUM) the gradient over `group`.

    Megatron's `copy_to_tensor_model_parallel_region` does the same but all-reduces
    `grad.contiguous()` and returns `grad`: when the gradient arrives non-contiguous (einsum's
    backward hands a transposed one to KHA's folded matrices) the sum lands in a discarded copy.
    """

    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group.size() == 1:
            return grad, None
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_replicated(param: torch.Tensor, group) -> torch.Tensor:
    """Use a TP-replicated parameter whose gradient must be summed over `group`.

    Each rank's gradient covers only its own heads or tokens; the backward all-reduce (SUM) makes it
    complete and identical on every rank, whatever the sequence-parallel setting, before DDP sees
    it. Forward is the identity.
    """
    return _SumGradOverGroup.apply(param, group)
