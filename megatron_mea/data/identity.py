"""What a `--data-path` prefix holds, as far as the run depends on it.

- `data_identity`: a digest of the `.idx` content and the `.bin` size, put in the key under
  which Megatron caches its sample indices (`--data-cache-path`). Megatron keys them by the
  settings and the path only, so data regenerated at the same path was read through the old
  data's offsets (an IndexError, or silently other samples).
- `DataWatch`: the files' size and modification time when the run loaded them, checked before
  micro-batches are read (every one, unless the checks would take over 1% of the time), so
  that a file truncated or rewritten under a running job stops it with one line naming the
  file. Megatron maps the files read-only; a truncation that lands while a micro-batch is
  being read is a SIGBUS no process can turn into a message.
"""

import hashlib
import json
import os
import time
from typing import Dict, List, Optional, Tuple

from megatron_mea.data.checks import DatasetError, read_cache, file_key
from megatron_mea.runtime.files import atomic_write

_CACHE = "data_identity.json"
_BLOCK = 1 << 24  # bytes hashed per read


def data_identity(prefix: str, cache_dir: Optional[str] = None) -> str:
    """`<blake2b of prefix.idx>-<bytes of prefix.bin>`: equal for equal data on any node.

    The `.idx` (20 bytes per document) is hashed in full, once per file version: the digest is
    kept in `cache_dir/data_identity.json`, keyed by the file's path, size, modification time
    and inode (`checks.file_key`).
    """
    idx = prefix + ".idx"
    key = file_key(idx)
    cache = os.path.join(cache_dir, _CACHE) if cache_dir else None
    known = read_cache(cache)
    digest = known.get(key)
    if digest is None:
        hasher = hashlib.blake2b(digest_size=16)
        with open(idx, "rb") as handle:
            for block in iter(lambda: handle.read(_BLOCK), b""):
                hasher.update(block)
        digest = hasher.hexdigest()
        if cache:
            os.makedirs(cache_dir, exist_ok=True)
            known[key] = digest
            with atomic_write(cache) as handle:  # every rank may: one temporary file each
                json.dump(known, handle)
    return f"{digest}-{os.path.getsize(prefix + '.bin')}"


class DataChanged(DatasetError):
    """A dataset file changed under the running job (the message names it)."""


class DataWatch:
    """The `.idx`/`.bin` files of `prefixes` as they were when the run loaded them.

    Args:
        prefixes: `--data-path` prefixes (without weights).
    """

    def __init__(self, prefixes: List[str]):
        self._next_check = 0.0  # time.monotonic() from which `check_often` checks again
        self.files: Dict[str, Tuple[int, int]] = {}
        for prefix in prefixes:
            for path in (prefix + ".idx", prefix + ".bin"):
                stat = os.stat(path)
                self.files[path] = (stat.st_size, stat.st_mtime_ns)

    def check(self) -> None:
        """Raise `DataChanged` naming the first file whose size or modification time is no
        longer the load's (one stat per file: microseconds)."""
        for path, (size, mtime) in self.files.items():
            try:
                stat = os.stat(path)
            except OSError as exc:
                raise DataChanged(f"{path}: gone under the running job "
                                  f"({exc.strerror})") from None
            if stat.st_size != size:
                raise DataChanged(f"{path}: changed under the running job ({size} bytes when "
                                  f"the run loaded it, {stat.st_size} now)")
            if stat.st_mtime_ns != mtime:
                raise DataChanged(f"{path}: rewritten under the running job (modified after "
                                  "the run loaded it)")

    def check_often(self) -> None:
        """`check`, unless the last one ended less than 100 times its own duration ago: the
        checks take at most 1% of the time. A few files on a local disk take microseconds, so
        every micro-batch is checked; a blend of thousands of files on a network file system
        is checked less often."""
        start = time.monotonic()
        if start < self._next_check:
            return
        self.check()
        end = time.monotonic()
        self._next_check = end + 100 * (end - start)
