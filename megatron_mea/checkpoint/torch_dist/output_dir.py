"""Output directories of the converters: only a new or empty directory is accepted, and the
output is written under a temporary name next to it and renamed at the end, so a conversion
that fails leaves nothing behind (no empty directory, no weights without their config).
"""

import contextlib
import os
import shutil
import uuid
from typing import Iterator, List

from megatron_mea.checkpoint.errors import ConversionError


def check_new_directory(path: str) -> None:
    """Refuse an output path that holds something already.

    Args:
        path: the output directory.

    Raises:
        ConversionError: `path` exists and is not an empty directory (the message lists a few
            of its entries).
    """
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ConversionError(f"{path}: exists and is not a directory; the output must be a new "
                              "or empty directory")
    entries = sorted(os.listdir(path))
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConversionError(f"{path}: not empty (holds {shown}); the output must be a new or "
                              "empty directory")


def _missing_parents(directory: str) -> List[str]:
    """`directory` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while directory and not os.path.exists(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return missing


@contextlib.contextmanager
def staged_directory(path: str) -> Iterator[str]:
    """Yield a fresh directory to write the output in; when the block succeeds it becomes `path`.

    The directory is `.<name>.partial-<random>` in the parent of `path`: the same file system,
    so the final rename is atomic and copies nothing. If the block raises, the staged directory
    and any parent directories this call created are removed.

    Args:
        path: the output directory (new, or existing and empty).

    Yields:
        The staged directory.

    Raises:
        ConversionError: `path` is not a new or empty directory (checked before anything is
            created, and again before the rename).
    """
    check_new_directory(path)
    final = os.path.abspath(path)
    parent = os.path.dirname(final)
    created = _missing_parents(parent)
    os.makedirs(parent, exist_ok=True)
    staged = os.path.join(parent, f".{os.path.basename(final)}.partial-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(staged)
        yield staged
        check_new_directory(path)  # something else may have written there meanwhile
        os.replace(staged, final)  # POSIX: replaces an empty directory
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        for directory in created:
            with contextlib.suppress(OSError):  # only if still empty
                os.rmdir(directory)
        raise
