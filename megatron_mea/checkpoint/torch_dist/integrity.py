"""What makes a checkpoint directory trustworthy to load: checksums and pickle scanning.

Checksums: `checksums.json` in each `iter_XXXXXXX` lists every file the save wrote with its size
and CRC-32 (zlib's, over 4 MiB blocks: the cheapest hash in the standard library, and one that
catches every burst of flipped bits up to 32 long). It guards against corruption on disk or in
transit, not against a forger, who can rewrite the list; the trust model is in docs/reliability.md.
Savers call `checksum_files` (each rank on its share of the files) and `write_checksums`;
loaders call `verify_checksums`. A checkpoint without the list (Megatron-LM's, or this
package's before it existed) loads with a warning.

Pickles: `scan_pickles` reads the `.metadata` index and every torch.save object the index points
at (`common.pt`, the byte objects in the shards) through `safe_pickle` before torch unpickles
them.
"""

import json
import logging
import os
import zlib
from typing import Dict, Iterable, Optional

from megatron_mea.checkpoint.torch_dist import layout
from megatron_mea.checkpoint.torch_dist.safe_pickle import (
    check_pickle,
    check_torch_save,
    load_pickle,
)
from megatron_mea.runtime.files import atomic_write

logger = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
COMMON_FILE = "common.pt"
_BLOCK = 4 << 20


class IntegrityError(ValueError):
    """A checkpoint file that is not what was saved, or that is not safe to unpickle."""


def crc32_of(path: str) -> str:
    """The CRC-32 of a file, as 8 hex digits."""
    value = 0
    with open(path, "rb") as handle:
        while True:
            block = handle.read(_BLOCK)
            if not block:
                return f"{value:08x}"
            value = zlib.crc32(block, value)


def checkpoint_files(directory: str) -> list:
    """The files a save wrote into `directory` (sorted; the checksum list itself excluded)."""
    return sorted(name for name in os.listdir(directory)
                  if name != CHECKSUMS and os.path.isfile(os.path.join(directory, name)))


def checksum_files(directory: str, names: Iterable[str]) -> Dict[str, dict]:
    """{name: {"bytes": size, "crc32": hex}} of the given files of `directory`."""
    return {name: {"bytes": os.path.getsize(os.path.join(directory, name)),
                   "crc32": crc32_of(os.path.join(directory, name))} for name in names}


def write_checksums(directory: str, entries: Dict[str, dict]) -> None:
    """Write `directory/checksums.json` (atomically) from `checksum_files` results."""
    with atomic_write(os.path.join(directory, CHECKSUMS), encoding="ascii") as handle:
        json.dump({"algorithm": "crc32", "files": dict(sorted(entries.items()))}, handle,
                  indent=0)


def read_checksums(directory: str) -> Optional[Dict[str, dict]]:
    """The checksum list of `directory`, or None where the checkpoint has none."""
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="ascii") as handle:
            listed = json.load(handle)
        files = listed["files"]
        if listed.get("algorithm") != "crc32" or not all(
            isinstance(v.get("bytes"), int) and isinstance(v.get("crc32"), str)
            for v in files.values()
        ):
            raise ValueError("unknown layout")
    except (ValueError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{path}: unreadable ({exc})") from None
    return files


def verify_checksums(directory: str, listed: Dict[str, dict], names: Iterable[str]) -> None:
    """Check the given listed files: present, the listed size, the listed CRC-32.

    Raises:
        IntegrityError: naming the first file that differs.
    """
    for name in names:
        path = os.path.join(directory, name)
        expected = listed[name]
        if not os.path.exists(path):
            raise IntegrityError(f"{path}: missing (listed in {CHECKSUMS})")
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            raise IntegrityError(f"{path}: {size} bytes, {expected['bytes']} when saved "
                                 "(truncated or overwritten)")
        if crc32_of(path) != expected["crc32"]:
            raise IntegrityError(f"{path}: checksum mismatch (its bytes changed after the save: "
                                 "a corrupt file)")


def is_complete(directory: str) -> bool:
    """Whether `directory` has a checksum list and every listed file with its size (cheap: the
    contents are not read)."""
    try:
        listed = read_checksums(directory)
    except IntegrityError:
        return False
    return listed is not None and all(
        os.path.isfile(os.path.join(directory, name))
        and os.path.getsize(os.path.join(directory, name)) == entry["bytes"]
        for name, entry in listed.items()
    )


def older_complete_iteration(directory: str) -> Optional[int]:
    """The newest `iter_XXXXXXX` next to `directory`, older than it, that `is_complete`."""
    root, this = layout.split_checkpoint_path(directory)
    if this is None:
        return None
    for iteration in reversed(layout.saved_iterations(root)):
        if iteration < this and is_complete(layout.checkpoint_dir(root, iteration)):
            return iteration
    return None


def fallback_hint(directory: str) -> str:
    """What to do about a corrupt checkpoint: the older complete one and the flag to load it."""
    iteration = older_complete_iteration(directory)
    if iteration is None:
        return "no older complete checkpoint is next to it"
    return (f"the older checkpoint {layout.directory_name(iteration)} is complete: pass "
            f"--ckpt-step {iteration} to load it instead")


def read_index(directory: str):
    """The torch_dist `.metadata` index of `directory`, unpickled from admitted types only."""
    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as handle:
        return load_pickle(handle, path)


def scan_pickles(directory: str, index) -> None:
    """Scan `common.pt` (if any) and every byte object the index points at, without running
    anything from them (`safe_pickle`).

    Args:
        directory: the `iter_XXXXXXX` directory.
        index: its `.metadata` (from `read_index`).

    Raises:
        UnsafePickleError: naming the file (and the object) and the global it names.
    """
    common = os.path.join(directory, COMMON_FILE)
    if os.path.exists(common):
        check_torch_save(common, common)
    byte_keys = {key for key, meta in index.state_dict_metadata.items()
                 if type(meta).__name__ == "BytesStorageMetadata"}
    for item_index, info in index.storage_data.items():
        if item_index.fqn not in byte_keys:
            continue
        path = os.path.join(directory, info.relative_path)
        with open(path, "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        check_torch_save(data, f"{path} (object {item_index.fqn!r})")


def check_index_pickle(directory: str) -> None:
    """Scan `.metadata` before torch's reader unpickles it."""
    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as handle:
        check_pickle(handle, path)
