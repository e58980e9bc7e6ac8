"""Preemption: SIGTERM / SIGINT / SIGHUP end a run with a checkpoint (`--exit-signal-handler`).

Schedulers send SIGTERM before they preempt a job, people press Ctrl-C (SIGINT), and a closed
terminal sends SIGHUP. With the handler installed (the default of `mea-pretrain`; Megatron-LM's
`--exit-signal-handler`), a signal only sets a flag and says so in one line; after every step
all ranks agree on it with one all-reduce (a rank that got no signal must still save its
shards), save a checkpoint and stop. The handler is installed before set-up, as Megatron-LM's
is: a signal during set-up stops the run at the end of the set-up stage in flight (nothing is
trained yet, so nothing needs saving).

A signal often arrives more than once: SLURM signals every process of a step and torchrun
forwards the same signal to its workers, so each worker gets SIGTERM twice within
milliseconds. Such a repeat must not cancel the save. Only a second SIGINT (Ctrl-C pressed
again), or a SIGTERM/SIGHUP repeated `REPEAT_WINDOW_S` or more after the first, ends the
process at once, with the default action of that signal and no checkpoint.
"""

import os
import signal
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A SIGTERM/SIGHUP repeated within this many seconds of the first signal is the same notice
# delivered by another route (the launcher's forward); later, it means "stop now". Preemption
# notices give 30 s or more before SIGKILL, and a save of a tiny model takes longer than the
# milliseconds between the duplicates.
REPEAT_WINDOW_S = 10.0


def _say(line: str) -> None:
    """Write one line to stderr from a signal handler (os.write: the handler may run while the
    main thread is inside a buffered write to stderr, which a print would re-enter)."""
    try:
        os.write(2, f"mea-pretrain: {line}\n".encode("ascii", "replace"))
    except OSError:
        pass  # stderr closed (the terminal gone, SIGHUP): the run goes on all the same


class ExitSignalHandler:
    """Catch `SIGNALS` between `__enter__` and `__exit__` (the previous handlers come back;
    nested `with` blocks keep the outermost's).

    Args:
        group: the process group that decides together. Default: None, the default group
            (every rank of the run; it may be created after `__enter__`).
        enabled: when False, install nothing and never stop (`--no-exit-signal-handler`).
            Default: True.
    """

    def __init__(self, group=None, enabled: bool = True):
        self.group = group
        self.enabled = enabled
        self.received: Optional[int] = None
        self._first_at: Optional[float] = None
        # What the run does on the first signal, as its acknowledgement says; the trainer
        # updates it (set-up, then a step with or without --save).
        self.plan = "stopping at the end of the set-up stage in flight (nothing trained yet)"
        # One acknowledgement per run, not per rank (every rank of a torchrun job gets it).
        self._announce = os.environ.get("RANK", "0") == "0"
        self._previous = {}
        self._depth = 0  # nested `with` blocks: the outermost installs and restores

    def __enter__(self) -> "ExitSignalHandler":
        self._depth += 1
        if self.enabled and self._depth == 1:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signum, now
            if self._announce:
                again = ("press Ctrl-C again to exit without one" if signum == signal.SIGINT
                         else f"Ctrl-C, or {name} again after {REPEAT_WINDOW_S:g} s, exits "
                              "without one")
                _say(f"{name}: {self.plan}; {again}")
            return
        if signum != signal.SIGINT and now - self._first_at < REPEAT_WINDOW_S:
            return  # the same notice again (SLURM signals the workers, torchrun forwards it)
        # Ctrl-C again, or a repeat long after the first: leave now, as the default action does.
        _say(f"second signal ({name}): exiting without a checkpoint")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def agreed_stop(self, failed: bool = False) -> Tuple[Optional[int], Optional[int]]:
        """(the signal that stops the run, the lowest rank whose step failed), the same on
        every rank; (None, None): go on.

        A collective: every rank of `group` calls it at the same points (once per step, and
        between set-up stages; one all-reduce, also with the handler disabled, so that a
        rank's failure, e.g. rank 0's metrics.jsonl write, stops them all). Where ranks got
        different signals the highest number wins (only the exit status depends on it).

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
