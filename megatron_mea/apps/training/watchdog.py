"""A wedged rank: which rank stopped answering when a collective times out.

Every collective of a run waits at most `--distributed-timeout-minutes` (Megatron-LM's flag,
passed to `init_process_group` and Megatron's groups); then the waiting rank gets a
`RuntimeError` that names no peer. To name one, each rank runs a `Heartbeat`: a thread that
counts up a key of its own in the rendezvous store every `interval` seconds, whatever the main
thread is blocked in. A process that is stopped (SIGSTOP, a debugger, a node swapping itself to
death) stops counting; one that is alive but blocked in a collective keeps counting. On a
timeout, `stopped_ranks` reads every counter twice, `2.5 * interval` apart: those that did not
move stopped answering. Counters, not clocks, so the hosts' clocks need not agree.
"""

import logging
import re
import threading
import time
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

logger = logging.getLogger(__name__)

_KEY = "mea-heartbeat/{}"


# The wordings of a collective, or the store, waiting past its timeout: gloo ("Timed out
# waiting 9000ms for recv operation to complete", "Application timeout caused pair closure"),
# NCCL's watchdog ("Watchdog caught collective operation timeout: WorkNCCL(...) ran for 600000
# milliseconds before timing out"), the TCP store ("Socket Timeout", "wait timeout after
# 30000ms", "Timed out after 1801 seconds waiting for clients"), monitored barriers ("Rank 1
# failed to pass monitoredBarrier in 600000 ms").
_TIMEOUT = re.compile(r"\btimed out\b|\btim(e|ing) ?out\b|failed to pass monitoredbarrier",
                      re.IGNORECASE)


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a collective (or the rendezvous
    store) that waited past its timeout (Megatron re-raises some as a plain `Exception`, e.g.
    the dataset builder's "failed to build" from gloo's timed-out barrier; torch's checkpoint
    reader and writer gather them into a `CheckpointException`)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if (isinstance(exc, (RuntimeError, TimeoutError, CheckpointException))
                and _TIMEOUT.search(str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Heartbeat:
    """This rank's heartbeat in the default process group's store, from `start` to `stop`.

    Args:
        timeout_minutes: the collectives' timeout; the beat is a tenth of it (at most 10 s,
            at least 0.2 s).
    """

    def __init__(self, timeout_minutes: float):
        self.interval = min(max(timeout_minutes * 6.0, 0.2), 10.0)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Heartbeat":
        """Post the first beat (every rank has a key from now on) and keep beating."""
        self.store.add(_KEY.format(self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="mea-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the beating thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1.0)
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(_KEY.format(self.rank), 1)
            except Exception:  # noqa: BLE001 -- the store's host is gone: nothing to post to
                return

    def stopped_ranks(self) -> Optional[List[int]]:
        """The ranks whose heartbeat did not move in `2.5 * interval` (None: the store itself
        did not answer, i.e. the process hosting it stopped: rank 0, or torchrun's agent)."""
        self.store.set_timeout(timedelta(seconds=2 * self.interval + 1.0))
        keys = [_KEY.format(rank) for rank in range(self.world_size)]
        try:
            before = [self.store.add(key, 0) for key in keys]
            time.sleep(2.5 * self.interval)
            after = [self.store.add(key, 0) for key in keys]
        except Exception:  # noqa: BLE001 -- any store failure means the same here
            return None
        return [rank for rank, (a, b) in enumerate(zip(before, after))
                if a == b and rank != self.rank]


def describe_timeout(heartbeat: Optional[Heartbeat], timeout_minutes: float) -> str:
    """The part of the timeout's line that says who stopped answering."""
    waited = f"a collective waited {timeout_minutes:g} min (--distributed-timeout-minutes)"
    if heartbeat is None:
        return f"{waited}; no heartbeat to tell which rank stopped"
    stopped = heartbeat.stopped_ranks()
    if stopped is None:
        return (f"{waited}, and the rendezvous store does not answer either: the process "
                "hosting it (rank 0, or torchrun's agent) stopped answering")
    if not stopped:
        return (f"{waited}, yet every rank's heartbeat goes on: the ranks are alive but "
                "blocked (collectives called in a different order on some rank?)")
    names = ", ".join(str(rank) for rank in stopped)
    return f"{waited} for rank {names}, which stopped answering (no heartbeat)"
