"""Checks of `--data-path` files and `--split` before Megatron reads them.

Megatron asserts on a bad `.idx` header, reads past the end of a truncated `.bin` and, for a
split that receives no document or an index entry with a negative length, loops forever while
sizing its epochs; other damaged entries read other samples than the data's. Here each of these
is a `DatasetError` naming the file (and the first bad entry), or the split with the document
counts, before any index is built.
A token id the model's vocabulary does not have (data tokenized for another vocabulary) is named
with the file before the model is built (`check_token_ids`), where training would fail at the
first batch holding one, inside the embedding.
"""

import json
import os
import re
import struct
from importlib.util import find_spec
from typing import Dict, Optional

import numpy
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

from megatron_mea.runtime.files import atomic_write

SPLIT_NAMES = ("train", "valid", "test")
_HEADER_BYTES = 34  # magic (9), version (8), dtype code (1), sequence and document counts (8 + 8)


class DatasetError(ValueError):
    """A dataset file or split that cannot be used (the message names the file or the split)."""


def check_dataset_files(prefix: str, cache_dir: Optional[str] = None) -> int:
    """Check `prefix.idx` and `prefix.bin` against each other; returns the number of documents.

    Beyond the header, every entry of the index is checked (`_check_entries`: O(documents),
    vectorised); a damaged entry makes Megatron loop forever sizing its epochs (a negative
    token count), read other samples than the data's, or fail steps later inside the model.
    The result is kept per file version (path, size, modification time, inode of both files):
    in this process, and in `cache_dir/checked_indices.json` when `cache_dir` exists, so that
    a resumed run does not check again.

    Raises:
        DatasetError: a missing, empty or truncated file, an `.idx` that is not Megatron's
            format or has a damaged entry (the first one named), a `.bin` shorter than its
            index says, or a dataset without documents.
    """
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: missing")
    key = f"{file_key(idx)}|{file_key(bin_path)}"
    cache = os.path.join(cache_dir, _CHECKED_CACHE) if cache_dir else None
    known = _CHECKED[key] if key in _CHECKED else read_cache(cache).get(key)
    if isinstance(known, int):
        _CHECKED[key] = known
        return known
    size = os.path.getsize(idx)
    if size < _HEADER_BYTES:
        raise DatasetError(f"{idx}: empty or truncated ({size} bytes; a Megatron .idx file has "
                           f"a {_HEADER_BYTES}-byte header)")
    with open(idx, "rb") as handle:
        header = handle.read(_HEADER_BYTES)
    if header[:9] != _INDEX_HEADER:
        raise DatasetError(f"{idx}: not a Megatron .idx file (bad header)")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1 or code not in {d.value for d in DType}:
        raise DatasetError(f"{idx}: unsupported .idx version {version} or dtype code {code}")
    needed = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if size < needed:
        raise DatasetError(f"{idx}: truncated ({size} bytes, its header needs {needed})")
    if sequences == 0 or documents < 2:
        raise DatasetError(f"{idx}: holds no documents")
    bin_needed = _check_entries(idx, code, sequences, documents)
    bin_size = os.path.getsize(bin_path)
    if bin_size < bin_needed:
        raise DatasetError(f"{bin_path}: truncated or empty ({bin_size} bytes, its index "
                           f"{idx} needs {bin_needed})")
    _CHECKED[key] = documents - 1
    if cache and os.path.isdir(cache_dir):  # never creates it: the run directory's owner does
        known = read_cache(cache)
        known[key] = documents - 1
        with atomic_write(cache) as handle:  # every rank may: one temporary file each
            json.dump(known, handle)
    return documents - 1


# Index entries checked per chunk of `_check_entries` (bounds its memory to ~150 MiB).
_ENTRY_CHUNK = 1 << 22
# Files that passed `check_dataset_files` in this process: {file keys: documents}.
_CHECKED: Dict[str, int] = {}
_CHECKED_CACHE = "checked_indices.json"


def _check_entries(idx: str, code: int, sequences: int, documents: int) -> int:
    """Check every entry of the `.idx` whose header says `sequences` and `documents`; returns
    the bytes of `.bin` the index describes.

    Megatron's index holds, after the header, the sequence lengths (int32 [sequences], in
    tokens), the sequence pointers (int64 [sequences], byte offsets into the `.bin`) and the
    document indices (int64 [documents], the first sequence of each document, then the
    sequence count). Its writer lays the sequences end to end from byte 0: pointer[0] == 0 and
    pointer[i + 1] == pointer[i] + length[i] * itemsize. Raises `DatasetError` naming the
    first entry that breaks this.
    """
    itemsize = DType.size(code)
    lengths = numpy.memmap(idx, dtype=numpy.int32, mode="r", offset=_HEADER_BYTES,
                           shape=(sequences,))
    pointers = numpy.memmap(idx, dtype=numpy.int64, mode="r",
                            offset=_HEADER_BYTES + 4 * sequences, shape=(sequences,))
    end = 0  # where the sequences so far end in the .bin (bytes)
    for start in range(0, sequences, _ENTRY_CHUNK):
        length = numpy.asarray(lengths[start:start + _ENTRY_CHUNK], dtype=numpy.int64)
        negative = numpy.flatnonzero(length < 0)
        if negative.size:
            i = start + int(negative[0])
            raise DatasetError(f"{idx}: damaged index: sequence {i} of {sequences} has "
                               f"length {int(lengths[i])} (negative)")
        pointer = numpy.asarray(pointers[start:start + _ENTRY_CHUNK])
        ends = pointer + length * itemsize
        expected = numpy.concatenate(([end], ends[:-1]))
        moved = numpy.flatnonzero(pointer != expected)
        if moved.size:
            i = start + int(moved[0])
            before = (f"sequence {i - 1} (length {int(lengths[i - 1])}) ends at byte "
                      f"{int(expected[moved[0]])}" if i else "the first sequence starts at 0")
            raise DatasetError(f"{idx}: damaged index: sequence {i} of {sequences} starts at "
                               f"byte {int(pointers[i])}, but {before}")
        end = int(ends[-1])
    document_indices = numpy.memmap(idx, dtype=numpy.int64, mode="r",
                                    offset=_HEADER_BYTES + 12 * sequences, shape=(documents,))
    if document_indices[0] != 0:
        raise DatasetError(f"{idx}: damaged index: document index 0 of {documents} is "
                           f"{int(document_indices[0])}, expected 0 (the first sequence)")
    previous = 0  # each document starts at or after the one before it
    for start in range(0, documents, _ENTRY_CHUNK):
        chunk = numpy.asarray(document_indices[start:start + _ENTRY_CHUNK])
        falling = numpy.flatnonzero(chunk < numpy.concatenate(([previous], chunk[:-1])))
        if falling.size:
            i = start + int(falling[0])
            raise DatasetError(f"{idx}: damaged index: document index {i} of {documents} is "
                               f"{int(document_indices[i])}, below the one before it "
                               f"({int(document_indices[i - 1])})")
        previous = int(chunk[-1])
    if previous != sequences:
        raise DatasetError(f"{idx}: damaged index: its last document index is {previous}, "
                           f"expected the sequence count {sequences}")
    return end


def file_key(path: str) -> str:
    """`path` as it is now: absolute path, size, modification time and inode (a file
    rewritten or replaced at the same path gets another key)."""
    stat = os.stat(path)
    return f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"


def read_cache(cache: Optional[str]) -> dict:
    """The JSON object in `cache`; {} without one (a damaged cache is only a cache)."""
    if not cache or not os.path.isfile(cache):
        return {}
    try:
        with open(cache, encoding="utf-8") as handle:
            known = json.load(handle)
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def check_splits(prefix: str, documents: int, split: str) -> None:
    """Refuse a `--split` that gives a split of positive weight no document of `prefix` (Megatron
    would loop forever building its indices).

    The documents of each split are Megatron's: `round(begin x n)` to `round(end x n)` of the
    normalized cumulative weights.
    """
    weights = [float(part) for part in re.findall(r"[.0-9]+", split)]  # as Megatron parses it
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if len(weights) != 3 or total <= 0:
        raise DatasetError(f"--split {split}: expected up to three weights with a positive sum")
    bounds = numpy.cumsum([0.0] + [w / total for w in weights])
    counts = [int(round(bounds[i + 1] * documents)) - int(round(bounds[i] * documents))
              for i in range(3)]
    for name, weight, count in zip(SPLIT_NAMES, weights, counts):
        if weight > 0 and count == 0:
            shares = ", ".join(f"{n} {c}" for n, c in zip(SPLIT_NAMES, counts))
            raise DatasetError(
                f"--split {split}: the {name} split of {prefix} gets 0 of its {documents} "
                f"documents ({shares}); give it weight 0 or use more data"
            )


# Tokens scanned per chunk of `check_token_ids` (64 MiB of uint16).
_SCAN_CHUNK = 1 << 25


def check_token_ids(prefix: str, vocab_size: int, cache_dir: Optional[str] = None) -> int:
    """Refuse a dataset holding a token id of `vocab_size` or more; returns its largest id.

    The whole `.bin` is scanned (at disk speed; a progress bar from 1 GiB on); the result
    is kept in `cache_dir` (the run's `--data-cache-path`), keyed by the file's path, size,
    modification time and inode, so a resumed run does not scan again.

    Raises:
        DatasetError: naming the file, its largest id and the vocabulary size.
    """
    key = file_key(prefix + ".bin")
    cache = os.path.join(cache_dir, "max_token_ids.json") if cache_dir else None
    known = read_cache(cache)
    largest = known.get(key)
    if largest is None:
        largest = _largest_id(prefix)
        if cache:
            os.makedirs(cache_dir, exist_ok=True)
            known[key] = largest
            with atomic_write(cache) as handle:  # every rank may: one temporary file each
                json.dump(known, handle)
    if largest >= vocab_size:
        raise DatasetError(
            f"{prefix}.bin holds token id {largest}, the model's vocabulary has {vocab_size} "
            "ids (0 to {}): data tokenized for another vocabulary? Set --vocab-size or "
            "--tokenizer-model to the data's".format(vocab_size - 1)
        )
    return largest


def _largest_id(prefix: str) -> int:
    with open(prefix + ".idx", "rb") as handle:
        code = struct.unpack("<QBQQ", handle.read(_HEADER_BYTES)[9:])[1]
    tokens = numpy.memmap(prefix + ".bin", dtype=DType.dtype_from_code(code), mode="r")
    chunks = range(0, len(tokens), _SCAN_CHUNK)
    if tokens.nbytes >= 1 << 30 and find_spec("tqdm") is not None:  # a nicety: no tqdm, no bar
        from tqdm import tqdm

        chunks = tqdm(chunks, desc=f"checking token ids of {os.path.basename(prefix)}.bin",
                      unit="chunk")
    largest = -1
    for start in chunks:
        largest = max(largest, int(tokens[start:start + _SCAN_CHUNK].max()))
    return largest
