"""A full disk as a test can make one: a file-size limit on this process."""

import contextlib
import resource


@contextlib.contextmanager
def file_size_limit(size: int):
    """RLIMIT_FSIZE of `size` bytes in this process for the block: the kernel fails a write
    past it with EFBIG, as a full disk fails one with ENOSPC (Python ignores SIGXFSZ); the
    writers' short-write paths are the same. Set what the block needs up before entering it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
