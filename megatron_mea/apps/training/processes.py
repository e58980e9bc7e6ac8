"""The helper processes of a training run die with it, however it dies.

Megatron's checkpoint writer starts helper processes: a `multiprocessing` Manager (spawned, it
holds the writers' result queue for the life of the trainer) and forked writers per save. A
trainer killed with SIGKILL runs no clean-up, and these would outlive it (each holding the
trainer's memory image). Linux's `PR_SET_PDEATHSIG` makes the kernel kill a process when its
parent dies: `children_die_with_parent` sets it in every process forked from the trainer and in
the Manager, which it starts itself for that reason.

They also ignore SIGTERM, SIGINT and SIGHUP. A scheduler, torchrun, `timeout` or `kill -TERM
-PGID` signals the trainer's whole process group, helpers included; the trainer answers such a
signal by saving a checkpoint, which needs its helpers alive (a Manager killed by the signal
fails that save with "Broken pipe"). The helpers stop with the trainer anyway.
"""

import ctypes
import multiprocessing
import os
import signal
import sys
from multiprocessing.managers import SyncManager
from typing import Optional

_PR_SET_PDEATHSIG = 1
# What the trainer answers by saving (`megatron_mea.apps.training.signals.SIGNALS`): its helpers
# ignore them.
_SHELTERED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_installed = False


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing).

    Args:
        parent_pid: the parent it must have; exit at once if the parent is already gone (it
            died before the request was made).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def helper_process(parent_pid: Optional[int] = None) -> None:
    """Set up this process as a helper of the trainer: it ignores the signals the trainer
    saves on, and dies with its parent (`die_with_parent`)."""
    for signum in _SHELTERED:
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(parent_pid)


def children_die_with_parent() -> None:
    """From now on, the processes this process starts for checkpoint writing die with it and
    ignore the signals it saves on (`helper_process`; idempotent; call before the first save).

    Every `os.fork` from now on runs `helper_process` in the child (the checkpoint writers;
    `subprocess` and the `spawn` context do not fork through Python, so they are unaffected).
    """
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    _installed = True
    os.register_at_fork(after_in_child=helper_process)
    # Megatron creates the Manager on first use, spawned (no fork hook runs in it) and without
    # an initializer: create it here, with one, in the module global Megatron reads.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=helper_process, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
