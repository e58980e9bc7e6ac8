"""Count what every `torch.distributed` collective call sends, for benchmarks (not for training).

`CollectiveCounter` wraps the collective functions of `torch.distributed` and every reference to
them that Megatron captured at import time (e.g. `tensor_parallel.mappings.dist_all_gather_func`),
records one `CollectiveCall` per call, and restores everything on exit.

Bytes are what this rank sends under direct (pairwise) algorithms, the model the formulas of
`parallel/exchange.py` use: an all-to-all sends every chunk but its own, an all-gather sends its
input to the `t-1` others, a reduce-scatter sends `t-1` of its `t` output-sized chunks; an
all-reduce is counted as a ring (`2 (t-1)/t` of the tensor).
"""

import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

_COLLECTIVES = (
    "all_to_all_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_reduce",
    "all_gather",
    "broadcast",
    # torch >= 2.13 names; the deprecated ones above may call them: only the outer call counts.
    "all_gather_single",
    "reduce_scatter_single",
)


@dataclass
class CollectiveCall:
    op: str
    sent_bytes: int
    tensor_bytes: int  # the size of the tensor handed to the call (input, or the in-place one)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes`: `2 (t-1)/t` of them."""
    return 2 * (world_size - 1) * nbytes // world_size


def _group_size(kwargs) -> int:
    return dist.get_world_size(kwargs.get("group"))


def _sent_bytes(op: str, args, kwargs) -> CollectiveCall:
    t = _group_size(kwargs)
    if op == "all_to_all_single":
        output, source = args[0], args[1]
        in_splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        total = _nbytes(source)
        if in_splits:
            row = total // max(1, source.shape[0])
            rank = dist.get_rank(kwargs.get("group"))
            sent = (sum(in_splits) - in_splits[rank]) * row
        else:
            sent = total * (t - 1) // t
        return CollectiveCall(op, sent, total)
    if op in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
        source = args[1]
        return CollectiveCall(op, _nbytes(source) * (t - 1), _nbytes(source))
    if op in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"):
        output, source = args[0], args[1]
        return CollectiveCall(op, _nbytes(output) * (t - 1), _nbytes(source))
    if op == "all_reduce":
        tensor = args[0]
        return CollectiveCall(op, ring_all_reduce_bytes(_nbytes(tensor), t), _nbytes(tensor))
    if op == "all_gather":
        tensor = args[1]
        return CollectiveCall(op, _nbytes(tensor) * (t - 1), _nbytes(tensor))
    tensor = args[0]  # broadcast: counted as sent by everyone (an upper bound)
    return CollectiveCall(op, _nbytes(tensor), _nbytes(tensor))


class CollectiveCounter:
    """Context manager recording every collective call made inside it (this process only)."""

    def __init__(self):
        self.calls: List[CollectiveCall] = []
        self._patched: List[tuple] = []
        self._depth = 0

    def _wrap(self, op: str, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls.append(_sent_bytes(op, args, kwargs))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        counted.__wrapped__ = original
        return counted

    def __enter__(self):
        wrappers = {}
        for op in _COLLECTIVES:
            original = getattr(dist, op, None)
            if original is not None:
                wrappers[id(original)] = self._wrap(op, original)
                self._patched.append((dist, op, original))
                setattr(dist, op, wrappers[id(original)])
        # Megatron keeps module-level aliases of some of them, taken at import time.
        for name, module in list(sys.modules.items()):
            if not name.startswith("megatron") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if callable(value) and id(value) in wrappers:
                    self._patched.append((module, attr, value))
                    setattr(module, attr, wrappers[id(value)])
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()
        return False

    def reset(self) -> None:
        self.calls.clear()

    def summary(self) -> Dict[str, Dict[str, int]]:
        """Per op: number of calls and bytes sent."""
        table: Dict[str, Dict[str, int]] = {}
        for call in self.calls:
            row = table.setdefault(call.op, {"calls": 0, "sent_bytes": 0})
            row["calls"] += 1
            row["sent_bytes"] += call.sent_bytes
        return table

    @property
    def sent_bytes(self) -> int:
        return sum(call.sent_bytes for call in self.calls)
