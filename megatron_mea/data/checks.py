"""Checks of `--data-path` files and `--split` before Megatron reads them.

Megatron asserts on a bad `.idx` header, reads past the end of a truncated `.bin` and, for a
split that receives no document, loops forever while sizing its epochs. Here each of these is a
`DatasetError` naming the file, or the split with the document counts, before any index is built.
"""

import os
import re
import struct

import numpy
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

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
