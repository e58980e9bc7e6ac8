"""Checks of `--data-path` files and `--split` before Megatron reads them.

Megatron asserts on a bad `.idx` header, reads past the end of a truncated `.bin` and, for a
split that receives no document, loops forever while sizing its epochs. Here each of these is a
`DatasetError` naming the file, or the split with the document counts, before any index is built.
A token id the model's vocabulary does not have (data tokenized for another vocabulary) is named
with the file before the model is built (`check_token_ids`), where training would fail at the
first batch holding one, inside the embedding.
"""

import json
import os
import re
import struct
from importlib.util import find_spec
from typing import Optional

import numpy
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

from megatron_mea.files import atomic_write

SPLIT_NAMES = ("train", "valid", "test")
_HEADER_BYTES = 34  # magic (9), version (8), dtype code (1), sequence and document counts (8 + 8)


class DatasetError(ValueError):
    """A dataset file or split that cannot be used (the message names the file or the split)."""


def check_dataset_files(prefix: str) -> int:
    """Check `prefix.idx` and `prefix.bin` against each other; returns the number of documents.

    Raises:
        DatasetError: a missing, empty or truncated file, an `.idx` that is not Megatron's
            format, a `.bin` shorter than its index says, or a dataset without documents.
    """
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: missing")
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
    lengths = numpy.memmap(idx, dtype=numpy.int32, mode="r", offset=_HEADER_BYTES,
                           shape=(sequences,))
    pointers = numpy.memmap(idx, dtype=numpy.int64, mode="r",
                            offset=_HEADER_BYTES + 4 * sequences, shape=(sequences,))
    bin_needed = int(pointers[-1]) + int(lengths[-1]) * DType.size(code)
    bin_size = os.path.getsize(bin_path)
    if bin_size < bin_needed:
        raise DatasetError(f"{bin_path}: truncated or empty ({bin_size} bytes, its index "
                           f"{idx} needs {bin_needed})")
    return documents - 1


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
    is kept in `cache_dir` (the run's `--data-cache-path`), keyed by the file's path, size and
    modification time, so a resumed run does not scan again.

    Raises:
        DatasetError: naming the file, its largest id and the vocabulary size.
    """
    bin_path = os.path.abspath(prefix + ".bin")
    stat = os.stat(bin_path)
    key = f"{bin_path}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = os.path.join(cache_dir, "max_token_ids.json") if cache_dir else None
    known = {}
    if cache and os.path.isfile(cache):
        try:
            with open(cache, encoding="utf-8") as handle:
                known = json.load(handle)
        except (OSError, ValueError):
            known = {}  # a damaged cache is only a cache: scan again
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
