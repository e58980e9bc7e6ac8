"""Files written all or nothing: a reader finds the old file or the whole new one, never a part
of it, also after the writer is killed or the machine loses power.

The new content goes to a temporary file beside the target, is flushed to disk (`fsync`), and is
renamed over the target (atomic on POSIX within one file system); the directory is synced after,
so that the rename itself survives a power loss. A failed write removes its temporary file and
leaves the target as it was.

`no_room_cause` says in plain words why a write found no room (a full disk, a quota, a file-size
limit), however the writer reported it.
"""

import contextlib
import errno
import os
import re
import resource
from typing import IO, Iterator, List, Optional


def temporary_name(path: str) -> str:
    """The temporary file `atomic_write` writes `path` through: beside it, named for this
    process (processes that write the same file do not write into each other's)."""
    return f"{path}.{os.getpid()}.tmp"


def _sync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(finished: str, path: str) -> None:
    """Rename the completely written file `finished` over `path`, durably: its data is synced
    before the rename and the directory after it. `atomic_write` ends with it; files another
    library writes (a dataset builder, a tar archive) are published with it directly."""
    with open(finished, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(finished, path)
    _sync_directory(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", encoding: Optional[str] = "utf-8") -> Iterator[IO]:
    """Open `path` for writing, all or nothing: the handle writes a temporary file that replaces
    `path` when the block ends without an exception (`publish`), and is removed when it raises.

    Args:
        path: the file to write.
        mode: `"w"` (text) or `"wb"` (bytes).
        encoding: of a text file.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode ({mode!r}) must be 'w' or 'wb'")
    staged = temporary_name(path)
    try:
        with open(staged, mode, encoding=None if mode == "wb" else encoding) as handle:
            yield handle
        publish(staged, path)
    finally:
        if os.path.exists(staged):
            os.remove(staged)


# Why a write found no room, in plain words, by errno.
_NO_ROOM = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file size limit reached (ulimit -f)"}


def no_room_cause(exc: BaseException, path: str) -> Optional[str]:
    """"disk full", "disk quota exceeded" or "file size limit reached (ulimit -f)" when `exc`
    (or an error it wraps) is a write into `path` (a file or directory being written) that
    found no room; else None.

    The writers report it three ways: an `OSError` with its errno (Python's files); an error
    whose message ends in `(os error N)` (safetensors' Rust writer); and torch's archive writer
    (`torch.save`), for which a short write is a `RuntimeError` "unexpected pos N vs M" with no
    errno: there the cause is looked up (the file system of `path` has less than 1 MiB left:
    disk full; a file-size limit is set: that limit).
    """
    for error in _wrapped(exc):
        code = error.errno if isinstance(error, OSError) else None
        message = str(error) if code is None else ""
        found = re.search(r"\(os error (\d+)\)", message)
        if found:
            code = int(found[1])
        elif re.search(r"unexpected pos \d+ vs \d+", message):
            code = _short_write_cause(path)
            if code is None:
                return "a short write (disk full or a file size limit)"
        if code in _NO_ROOM:
            return _NO_ROOM[code]
    return None


def _wrapped(exc: BaseException) -> List[BaseException]:
    """`exc`, the errors it was raised from or while handling, and the per-rank errors that
    torch.distributed.checkpoint's `CheckpointException` holds in `failures`."""
    found: List[BaseException] = []
    pending = [exc]
    while pending:
        error = pending.pop()
        if error is None or any(error is seen for seen in found):
            continue
        found.append(error)
        pending += [error.__cause__, error.__context__]
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            pending += [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair]
    return found


def _short_write_cause(path: str) -> Optional[int]:
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the output may be gone already (removed on failure)
        existing = os.path.dirname(existing)
    stat = os.statvfs(existing)
    if stat.f_bavail * stat.f_frsize < 1 << 20:
        return errno.ENOSPC
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return errno.EFBIG
    return None
