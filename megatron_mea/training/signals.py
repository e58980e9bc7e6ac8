"""Preemption: SIGTERM / SIGINT / SIGHUP end a run with a checkpoint (`--exit-signal-handler`).

Schedulers send SIGTERM before they preempt a job, people press Ctrl-C (SIGINT), and a closed
terminal sends SIGHUP. With the handler installed (the default of `mea-pretrain`; Megatron-LM's
`--exit-signal-handler`), a signal only sets a flag; after every step all ranks agree on it
with one all-reduce (a rank that got no signal must still save its shards), save a checkpoint
and stop. A second signal to a process whose first one is pending ends it at once, with the
default action of that signal.
"""

import os
import signal
import sys
from typing import Optional, Tuple

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ExitSignalHandler:
    """Catch `SIGNALS` between `__enter__` and `__exit__` (the previous handlers come back).

    Args:
        group: the process group that decides together (every rank of the run).
        enabled: when False, install nothing and never stop (`--no-exit-signal-handler`).
            Default: True.
    """

    def __init__(self, group, enabled: bool = True):
        self.group = group
        self.enabled = enabled
        self.received: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "ExitSignalHandler":
        if self.enabled:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            return
        # A second signal: leave now, as the signal's default action does.
        print(f"mea-pretrain: second signal ({signal.Signals(signum).name}): exiting without "
              "a checkpoint", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def agreed_stop(self, failed: bool = False) -> Tuple[Optional[int], Optional[int]]:
        """(the signal that stops the run, the lowest rank whose step failed), the same on
        every rank; (None, None): go on.

        A collective: every rank of `group` calls it once per step (one all-reduce, also with
        the handler disabled, so that a rank's failure, e.g. rank 0's metrics.jsonl write,
        stops them all). Where ranks got different signals the highest number wins (only the
        exit status depends on it).

        Args:
            failed: this rank's step failed (it ends the run with its own line).
        """
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        # MAX of (world - rank) picks the lowest failed rank.
        flags = torch.tensor([self.received or 0, world - rank if failed else 0],
                             dtype=torch.int32, device=device)
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        signum, failed_rank = int(flags[0].item()), int(flags[1].item())
        return signum or None, (world - failed_rank) if failed_rank else None
