"""Files written all or nothing: a reader finds the old file or the whole new one, never a part
of it, also after the writer is killed or the machine loses power.

The new content goes to a temporary file beside the target, is flushed to disk (`fsync`), and is
renamed over the target (atomic on POSIX within one file system); the directory is synced after,
so that the rename itself survives a power loss. A failed write removes its temporary file and
leaves the target as it was.
"""

import contextlib
import os
from typing import IO, Iterator, Optional


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
