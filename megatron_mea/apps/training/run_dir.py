"""The run directories of `mea-pretrain`: one writer per `--save`, no run started over another.

Three rules, checked on rank 0 before any model is built (`claim_run_directories`):

- A lock on `--save` (`mea-pretrain.lock`, an exclusive `flock` held for the whole run): a
  second run writing to the same directory is refused, naming the holder. The kernel drops the
  lock when its process dies, however it dies; a lock file left behind by a dead process is a
  stale lock: reported and taken over.
- `--load` must find a checkpoint (`--exit-on-missing-checkpoint`, the default here): a typo, a
  deleted `latest_checkpointed_iteration.txt` or a wrong path is an error, not a silent fresh
  start; `--no-exit-on-missing-checkpoint` asks for a fresh start when there is nothing to load.
- A run that does not continue the run in `--save` (a fresh start, or a `--load` of another
  directory) refuses a `--save` that holds checkpoints unless `--overwrite-save` is given; the
  previous run's `metrics.jsonl` is then moved aside (`metrics.jsonl.<n>`), so that the file
  only ever holds one run's steps. A run that continues from an older checkpoint of its own
  `--save` (`--ckpt-step N`) moves the later checkpoints aside (`--rewind-save`; refused
  without), so the directory never mixes two runs.

Rank 0 of a run that passed these checks also keeps a log file there (`RUN_LOG`, appended to by
every run of the directory): every log record from INFO, Megatron-Core's included, which the
console leaves out (`megatron_mea.runtime.console`).
"""

import fcntl
import logging
import os
import socket
import sys
import time
from typing import Optional, Tuple

from megatron_mea.checkpoint.torch_dist import layout

logger = logging.getLogger(__name__)

LOCK = "mea-pretrain.lock"
METRICS = "metrics.jsonl"
RUN_LOG = "mea-pretrain.log"


class RunDirectoryError(ValueError):
    """A `--save` or `--load` directory this run must not use as asked (one line)."""


class SaveLock:
    """An exclusive lock on a `--save` directory, held from `acquire` to `release` (or the
    process's death: `flock` locks die with their process)."""

    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, LOCK)
        self.fd: Optional[int] = None
        self.created = False  # whether acquire made the directory

    def acquire(self) -> None:
        """Take the lock or raise RunDirectoryError naming the run that holds it."""
        self.created = not os.path.isdir(self.root)
        os.makedirs(self.root, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd) or "another process"
                os.close(fd)
                raise RunDirectoryError(
                    f"--save {self.root}: in use by another run ({holder}; lock {self.path}); "
                    "two runs must not write to one directory: wait for it to end or choose "
                    "another --save"
                ) from None
            # The holder may have removed the file between our open and our lock: then the lock
            # is on a deleted file, and another process may lock a new one. Retry on the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read(fd)
        if stale:
            logger.warning("--save %s: stale lock of a run that is no longer running (%s); "
                           "taking it over", self.root, stale)
        holder = (f"pid {os.getpid()} on {socket.gethostname()}, started "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode("ascii", "replace"), 0)
        except OSError:  # no space for the holder's line: not held (the caller says why)
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent); remove the directory too where
        `acquire` made it and nothing was written there (a refused run leaves no empty --save).
        A lock file that cannot be removed (the directory made read-only) is only logged:
        closing drops the lock, and the next run takes the file over as stale."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("--save %s: could not remove the lock file %s (%s); the lock is "
                           "released all the same", self.root, self.path, _why(exc))
        os.close(self.fd)
        self.fd = None
        if self.created:
            try:
                os.rmdir(self.root)
            except OSError:  # not empty: the run wrote something
                pass


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("ascii", "replace").strip()


def _same_directory(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def check_load(args) -> bool:
    """Whether `--load` has a checkpoint to load; raise RunDirectoryError where it has none and
    a fresh start was not asked for (`--no-exit-on-missing-checkpoint`)."""
    if not args.load:
        return False
    if args.ckpt_step is not None:
        return True
    missing = layout.nothing_to_load(args.load)
    if missing is None:
        return True
    if not args.exit_on_missing_checkpoint:
        logger.warning("--load %s: no checkpoint there; starting from scratch "
                       "(--no-exit-on-missing-checkpoint)", args.load)
        return False
    raise RunDirectoryError(
        f"--load {args.load}: {missing}; pass --no-exit-on-missing-checkpoint to start from "
        "scratch instead"
    )


def check_save(args) -> bool:
    """Refuse a `--save` holding checkpoints of a run this one does not continue (unless
    `--overwrite-save`), and move that run's `metrics.jsonl` aside where this is a new run;
    returns whether `--load` has a checkpoint to load (`check_load`: whether this run continues
    the one in `--save` depends on it).

    `--load DIR --ckpt-step N --save DIR` continues the run in DIR from N: the checkpoints after
    N belong to the run being abandoned. Refused unless `--rewind-save`; then they move aside
    (`layout.rewind`), so that DIR holds one run."""
    loads = check_load(args)
    if not args.save:
        return loads
    root = args.save
    if not (loads and _same_directory(args.load, root)):
        held = layout.held_checkpoint(root)
        if held and not args.overwrite_save:
            start = f"loads {args.load}" if loads else "starts from scratch"
            raise RunDirectoryError(
                f"--save {root}: holds checkpoints of another run ({held}) and this run "
                f"{start}; pass --load {root} to continue that run, or --overwrite-save to "
                "write over it"
            )
        metrics = os.path.join(root, METRICS)
        if os.path.exists(metrics):
            number = 1
            while os.path.exists(f"{metrics}.{number}"):
                number += 1
            os.rename(metrics, f"{metrics}.{number}")
            logger.warning("--save %s: a new run; the previous run's %s is now %s.%d",
                           root, METRICS, METRICS, number)
        return loads
    step = args.ckpt_step
    # Nothing to abandon, or N is not there (the load names that).
    later = layout.later_checkpoints(root, step) if step is not None else []
    if not later:
        return loads
    if not args.rewind_save:
        raise RunDirectoryError(
            f"--save {root}: --ckpt-step {step} rewinds the run there, which has "
            f"{len(later)} later checkpoint(s) ({later[0]} .. {later[-1]}); "
            "pass --rewind-save to move them aside, or choose another --save"
        )
    aside = layout.rewind(root, step)
    logger.warning("--save %s: rewound to iteration %d; the %d later checkpoint(s) moved to %s",
                   root, step, len(later), aside)
    return loads


def claim_run_directories(args) -> Tuple[Optional[SaveLock], bool]:
    """Lock `--save` and apply the `--load` / `--save` rules (rank 0 only); returns the lock
    (None without `--save`), to be released at the end of the run, and whether `--load` has a
    checkpoint to load.

    Raises:
        RunDirectoryError: the directory is locked by a live run, cannot be written (read-only,
            a path too long for the file system), `--load` has no checkpoint, or `--save`
            holds another run's checkpoints.
    """
    lock = None
    if args.save:
        check_save_path(args.save)
        lock = SaveLock(args.save)
        try:
            lock.acquire()
        except OSError as exc:  # read-only, a file in the way, no space for the lock file
            raise RunDirectoryError(f"--save {args.save}: cannot write there "
                                    f"({_why(exc)})") from None
    try:
        loads = check_save(args)
    except BaseException as exc:
        if lock is not None:
            lock.release()
        if isinstance(exc, OSError):  # moving a previous run's files aside
            raise RunDirectoryError(f"cannot prepare the run directories ({_why(exc)})") from None
        raise
    return lock, loads


def _why(exc: OSError) -> str:
    return (exc.strerror or str(exc)) + (f": {exc.filename}" if exc.filename else "")


# The longest path the run writes under --save, past the directory itself: a shard of a
# checkpoint being written (`iter_XXXXXXX.tmp/__<rank>_<n>.distcp`), a rewound run's
# checkpoint, an atomic write's temporary file. 80 leaves room for ranks of 8 digits.
_LONGEST_INSIDE = 80


def check_save_path(root: str) -> None:
    """Refuse a `--save` the file system cannot hold files under: a name over its NAME_MAX,
    or a path that leaves no room below PATH_MAX for the checkpoint files (it would fail at
    the first save)."""
    path = os.path.abspath(root)
    existing = path
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    for name in path.split(os.sep):
        if len(name.encode()) > name_max:
            raise RunDirectoryError(
                f"--save {_short(root)}: the name {_short(name)} is {len(name.encode())} bytes, "
                f"over this file system's limit of {name_max}; choose a shorter --save")
    if len(path.encode()) + _LONGEST_INSIDE >= path_max:
        raise RunDirectoryError(
            f"--save {_short(root)}: the path is {len(path.encode())} bytes, and the "
            f"checkpoint files under it need up to {_LONGEST_INSIDE} more, over this system's "
            f"limit of {path_max - 1}; choose a shorter --save")


def _short(text: str) -> str:
    """A long path shortened for a one-line message."""
    return text if len(text) <= 100 else f"{text[:60]}...{text[-30:]}"


def attach_run_log(root: str) -> logging.Handler:
    """Append every log record from INFO to `root/RUN_LOG` (after a header line naming this
    process and its command line) until `detach_run_log`; returns the handler.

    The root logger's level decides what reaches the file: the tools set INFO
    (`megatron_mea.runtime.console`); a program that calls the trainer itself keeps its own level.
    """
    handler = logging.FileHandler(os.path.join(root, RUN_LOG), encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.stream.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                         f"{' '.join(sys.argv)}\n")
    logging.getLogger().addHandler(handler)
    return handler


def detach_run_log(handler: logging.Handler) -> None:
    """Stop writing the run's log file (`attach_run_log`) and close it."""
    logging.getLogger().removeHandler(handler)
    handler.close()
