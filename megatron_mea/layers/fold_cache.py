"""One optimizer step's folded `linear_qkv` weights, shared by its micro-batches.

Folded projections: MEA's `weights` TP exchange (HLC in the K/V rows) and KHA-Linear with
`kha_fold_linear` (`T^T W` per head).

Without the cache every micro-batch gathers and folds the K/V rows again (and reduce-scatters their
gradient). With it, the first training forward of a step folds once, keeps the autograd graph of
the fold, and hands the micro-batches a detached leaf copy; their weight gradients accumulate on
that leaf, and `flush_fold_caches` backpropagates the sum through the fold once, right before the
gradients are reduced (wrap Megatron's `finalize_model_grads` with `with_fold_flush`). So the
gather and its reduce-scatter run once per optimizer step, whatever the number of micro-batches.

Forgetting the flush would silently drop gradients, so a forward that finds the parameters changed
under a live cache (the optimizer stepped without a flush) raises instead.

    enable_fold_cache(model)                      # after building the model
    config.finalize_model_grads_func = with_fold_flush(finalize_model_grads)
"""

from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_mea.layers.attention import KHASelfAttention
from megatron_mea.layers.mea_attention import MEASelfAttention


class FoldCache:
    """The cached fold of one attention layer: graph outputs, their leaf copies, and the versions
    of the parameters they were built from."""

    def __init__(self):
        self._outputs: Optional[Tuple[torch.Tensor, ...]] = None
        self._leaves: Tuple[torch.Tensor, ...] = ()
        self._versions: Tuple[int, ...] = ()

    @property
    def live(self) -> bool:
        """A fold built this step and not yet flushed."""
        return self._outputs is not None

    def get(
        self, build: Callable[[], Sequence[Optional[torch.Tensor]]], params: List[torch.Tensor]
    ):
        """The leaves of this step's fold, building it on the first call.

        Args:
            build: computes the folded tensors (with autograd) from `params`.
            params: the parameters the fold reads; their version counters detect a missed flush.
        """
        versions = tuple(p._version for p in params)
        if self._outputs is not None:
            if versions != self._versions:
                raise RuntimeError(
                    "parameters changed under a cached folded linear_qkv weight: the optimizer "
                    "stepped without flush_fold_caches(); wrap finalize_model_grads with "
                    "megatron_mea.layers.with_fold_flush (see layers/fold_cache.py)"
                )
            return self._leaves
        outputs = tuple(build())
        self._outputs = outputs
        self._leaves = tuple(
            None if t is None else t.detach().requires_grad_(t.requires_grad) for t in outputs
        )
        self._versions = versions
        return self._leaves

    def flush(self) -> None:
        """Backpropagate the micro-batches' accumulated gradients through the fold; clear."""
        if self._outputs is None:
            return
        pairs = [
            (out, leaf.grad)
            for out, leaf in zip(self._outputs, self._leaves)
            if leaf is not None and leaf.grad is not None
        ]
        self._outputs, self._leaves, self._versions = None, (), ()
        if pairs:
            outputs, grads = zip(*pairs)
            torch.autograd.backward(outputs, grads)


def _caching_layers(model: torch.nn.Module):
    return [
        m for m in model.modules()
        if isinstance(m, (MEASelfAttention, KHASelfAttention)) and m.folds_projection
    ]


def enable_fold_cache(model: torch.nn.Module) -> int:
    """Give every layer of `model` that may fold its projection (MEA with `mea_tp_exchange`
    `weights` or `auto`, KHA with `kha_fold_linear`) a fold cache; returns how many got one."""
    layers = _caching_layers(model)
    for layer in layers:
        layer.fold_cache = FoldCache()
    return len(layers)


def flush_fold_caches(model_chunks: Iterable[torch.nn.Module]) -> None:
    """Send every cached fold's gradient to its parameters (call once per step, after the last
    micro-batch's backward and before the gradient reduction)."""
    for chunk in model_chunks:
        for layer in _caching_layers(chunk):
            if layer.fold_cache is not None:
                layer.fold_cache.flush()


def with_fold_flush(finalize_model_grads: Callable) -> Callable:
    """Wrap Megatron's `finalize_model_grads(model, num_tokens=None, ...)` to flush first."""

    def finalize(model, *args, **kwargs):
        flush_fold_caches(model)
        return finalize_model_grads(model, *args, **kwargs)

    return finalize
