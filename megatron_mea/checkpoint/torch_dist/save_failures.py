"""Why a checkpoint could not be written, in one line of plain words.

A save fails in the OS's words (`OSError`: "No space left on device", "File too large"), in
torch's archive writer's (`RuntimeError`: "[enforce fail at inline_container.cc:672] . unexpected
pos 64 vs 0", "basic_ios::clear: iostream error": a write that came up short, which is what a
full disk or a file-size limit looks like from there), or gathered from the ranks by torch's
distributed writer (`CheckpointException`, on the coordinating rank). `describe_failure` turns
each into a line that names the cause; where torch's words name none, it looks at the file
system (no space left) and at the process's file-size limit (`ulimit -f`, RLIMIT_FSIZE) to say
which.
"""

import os
import re
import resource
import traceback
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

# torch's archive writer (`torch.save`) reporting a write it could not complete: C++'s words,
# not the OS's ("unexpected pos 64 vs 0", "basic_ios::clear: iostream error", "PytorchStreamWriter
# failed writing file data/0: file write failed").
# An OS error that reached us as text, and Megatron-Core 0.19's words for a write worker that
# failed (its wrappers; another rank's error), are one too.
_TORCH_WRITE_ERROR = re.compile(r"unexpected pos|PytorchStreamWriter|inline_container|"
                                r"iostream error|file write failed|OSError|\[Errno \d+\]|"
                                r"error is caught while starting worker")


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a file over a size limit, a directory
    made read-only); the message names the checkpoint and the cause, in one line."""


def is_write_error(exc: BaseException) -> bool:
    """Whether `exc` is a failed write: the OS's error, the distributed writer's gathered
    ones, or a `RuntimeError` of torch's archive writer (raised inside `torch.save`, or in its
    words). Another `RuntimeError`, e.g. a collective that timed out, is not."""
    if isinstance(exc, (OSError, CheckpointException)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    if _TORCH_WRITE_ERROR.search(str(exc)):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any(frame.filename.endswith(os.path.join("torch", "serialization.py"))
               for frame in frames)


def free_bytes(path: str) -> Optional[int]:
    """Bytes this process may still write on the file system holding `path` (root may use
    the blocks reserved for it); None where that cannot be read."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    return blocks * stats.f_frsize


def no_space_left(path: str) -> Optional[str]:
    """The cause, in words, where the file system holding `path` is full (else None)."""
    free = free_bytes(path)
    if free == 0:
        return f"no space left on the device holding {path} (0 bytes free)"
    return None


def describe_failure(exc: BaseException, directory: Optional[str] = None,
                     local: bool = True) -> str:
    """One line for an error of a write: the OS's reason and the file where it says one; for
    torch's CheckpointException, the first failed rank's error (which it holds only on the
    coordinating rank); where the writer's words name no cause (torch's archive writer's
    short write, Megatron-Core's wrappers), the cause found on `directory`'s file system or in
    this process's file-size limit.

    Args:
        exc: the error.
        directory: where the write went (the checkpoint's directory). Default: None (the
            cause of a short write is then not looked for).
        local: `exc` happened in this process (its file-size limit is the one that counts).
            Default: True.
    """
    if isinstance(exc, CheckpointException):
        if not exc.failures:
            return "the checkpoint writer failed on another rank"
        rank, (error, _) = next(iter(exc.failures.items()))
        here = dist.is_initialized() and rank == dist.get_rank()
        return f"rank {rank}: {describe_failure(error, directory, local=here)}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # The writer's words name no cause ("unexpected pos 64 vs 0"; Megatron-Core 0.19's "An
    # error is caught while starting worker 0, error: <class 'OSError'>"): find it.
    full = no_space_left(directory) if directory is not None else None
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if full is not None:
        cause = full
    elif local and limit != resource.RLIM_INFINITY:
        cause = f"a file reached this process's file-size limit of {limit} bytes (ulimit -f)"
    elif is_write_error(exc):
        cause = "a write failed (a full disk, or a file-size limit: ulimit -f)"
    else:
        return text
    # "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0" -> its last part.
    words = re.sub(r"\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)
    return f"{cause} (the writer's words: {words})"
