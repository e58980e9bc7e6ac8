"""Turn raw text files into a Megatron `.bin/.idx` token dataset, reporting every bad input.

Input kinds, chosen by file extension:

- `.jsonl`, `.ndjson`, `.json`: JSON lines (Megatron-LM's "loose json"): one JSON object per line,
  the document text under `json_key`. Blank lines are not documents and are skipped.
- anything else (`.txt`, `.md`, `.py`...): the whole file is one document.

A malformed input (invalid JSON, a line that is not an object, a missing or non-string text field,
invalid UTF-8, a lone surrogate that cannot be encoded) is logged as a warning with `path:line`,
collected in `PreprocessSummary.errors` and skipped; the good documents are still written. Empty
documents are counted in `PreprocessSummary.empty_documents` and not written, because a zero-length
document only adds an entry to the index (or, with eod, a lone separator).

The dataset is written under temporary names in the output directory and renamed at the end, so a
crash never leaves a half-written dataset under `output_prefix`.
"""

import contextlib
import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import List

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_mea.runtime.files import no_room_cause, publish

try:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
except ImportError:  # the progress bar is a nicety; preprocessing works without it
    tqdm = None

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")

# Each error is logged up to this many times; all of them are kept in the summary regardless.
_MAX_LOGGED_ERRORS = 100


# Flags of Megatron-LM's tools/preprocess_data.py (core_v0.16.1 to core_v0.19.0 and later) that
# mean nothing to `preprocess_files`, and why: `mea-preprocess` accepts them, so that a
# Megatron-LM command line runs unchanged.
IGNORED_FLAGS = (
    ("--workers", int), ("--partitions", int), ("--keep-sequential-samples", bool),
    ("--split-sentences", bool), ("--keep-newlines", bool), ("--lang", str),
    ("--find-optimal-num-workers", bool), ("--workers-to-check", int),
    ("--max-documents", int), ("--performance-dir", str),
)
_ONE_PROCESS = "one process tokenizes here"
IGNORED_WHY = {
    "workers": _ONE_PROCESS,
    "partitions": "the inputs are read in one pass, in the order given",
    "keep_sequential_samples": "documents are always written in input order",
    "split_sentences": "each document is written whole, as one sequence: GPT pretraining "
                       "samples documents, sentence-level data is for BERT-style models",
    "keep_newlines": "it qualifies --split-sentences",
    "lang": "it qualifies --split-sentences",
    "find_optimal_num_workers": _ONE_PROCESS,
    "workers_to_check": _ONE_PROCESS,
    "max_documents": "it qualifies --find-optimal-num-workers",
    "performance_dir": "it qualifies --find-optimal-num-workers",
}


def expand_inputs(patterns: List[str]) -> List[str]:
    """The input files `patterns` name, in order: a file as given, a glob (`**` included) as the
    sorted files it matches.

    Raises:
        ValueError: a glob matches no file, or a name that is no glob is not a file.
    """
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"pattern {pattern!r} matches no file")
            paths.extend(matches)
        elif os.path.isfile(pattern):
            paths.append(pattern)
        else:
            raise ValueError(f"{pattern!r} is not a file")
    return paths


@dataclass
class PreprocessSummary:
    """What `preprocess_files` wrote and what it skipped.

    Attributes:
        output_prefix: the dataset prefix (`<prefix>.bin` / `<prefix>.idx`).
        files: the input files, in the order they were read.
        documents: documents written.
        tokens: tokens written, eod tokens included.
        empty_documents: documents skipped because they were empty.
        errors: one "path:line: message" per skipped malformed input, in input order.
        written: whether the dataset was published under `output_prefix` (False when no document
            was written, or in strict mode with errors).
    """

    output_prefix: str
    files: list[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    empty_documents: int = 0
    errors: list[str] = field(default_factory=list)
    written: bool = False

    def describe(self, max_errors: int = 10) -> str:
        """A human-readable report: counts, then the first `max_errors` errors."""
        lines = [
            f"input files: {len(self.files)}",
            f"documents written: {self.documents}",
            f"tokens written: {self.tokens}",
            f"empty documents skipped: {self.empty_documents}",
            f"malformed inputs skipped: {len(self.errors)}",
        ]
        lines += [f"  {err}" for err in self.errors[:max_errors]]
        if len(self.errors) > max_errors:
            lines.append(f"  ... and {len(self.errors) - max_errors} more")
        if self.written:
            lines.append(f"dataset written: {self.output_prefix}.bin/.idx")
        else:
            lines.append(f"dataset written: nothing ({self.why_empty()})")
        return "\n".join(lines)

    def why_empty(self) -> str:
        """Why no document was written, in one line naming the inputs: "a.jsonl: no documents
        (2 malformed inputs skipped)"."""
        names = ", ".join(self.files[:3]) + (f" and {len(self.files) - 3} more"
                                             if len(self.files) > 3 else "")
        skipped = [f"{count} {what} skipped" for count, what in (
            (len(self.errors), "malformed inputs"), (self.empty_documents, "empty documents"))
            if count]
        return f"{names}: no documents" + (f" ({', '.join(skipped)})" if skipped else "")


class PreprocessError(ValueError):
    """Raised in strict mode when any input was malformed; nothing is written.

    Attributes:
        summary: the `PreprocessSummary` of the run, with every error.
    """

    def __init__(self, summary: PreprocessSummary) -> None:
        super().__init__(
            f"{len(summary.errors)} malformed input(s), dataset not written:\n"
            + "\n".join(summary.errors[:10])
        )
        self.summary = summary


def _iter_jsonl(path: str, json_key: str, advance):
    """Yield (line number, text or None, error or None) for each non-blank line of `path`."""
    with open(path, "rb") as stream:
        for lineno, raw in enumerate(stream, 1):
            advance(len(raw))
            if not raw.strip():
                continue
            try:
                # utf-8-sig on the first line: editors on Windows prepend a byte-order mark.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield lineno, None, f"invalid UTF-8 at byte {err.start} of the line"
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield lineno, None, f"invalid JSON: {err.msg} (column {err.colno})"
                continue
            if not isinstance(record, dict):
                yield lineno, None, f"expected a JSON object, got {type(record).__name__}"
            elif json_key not in record:
                yield lineno, None, f"missing text field {json_key!r}"
            elif not isinstance(record[json_key], str):
                kind = type(record[json_key]).__name__
                yield lineno, None, f"text field {json_key!r} is {kind}, expected a string"
            else:
                yield lineno, record[json_key], None


def _iter_text_file(path: str, advance):
    """Yield the one document of a plain-text file as (1, text, None), or (line, None, error)."""
    with open(path, "rb") as stream:
        data = stream.read()
    advance(len(data))
    try:
        yield 1, data.decode("utf-8-sig"), None
    except UnicodeDecodeError as err:
        lineno = data.count(b"\n", 0, err.start) + 1
        yield lineno, None, f"invalid UTF-8 at byte {err.start} of the file"


def _publish(tmp_prefix: str, output_prefix: str) -> None:
    # The old .idx goes first: if we die between the renames, the prefix has a .bin but no .idx,
    # which IndexedDataset refuses, instead of a new .bin paired with a stale .idx.
    if os.path.exists(output_prefix + ".idx"):
        os.remove(output_prefix + ".idx")
    publish(tmp_prefix + ".bin", output_prefix + ".bin")
    publish(tmp_prefix + ".idx", output_prefix + ".idx")


def _add_documents(builder, paths, tokenizer, json_key, eod, summary, advance,
                   written=lambda: None) -> None:
    """Tokenize every document of `paths` into `builder`, recording skips in `summary`;
    `advance(bytes)` after each input read, `written()` after each document written."""
    vocab_size = tokenizer.vocab_size
    for path in paths:
        if path.lower().endswith(JSONL_SUFFIXES):
            documents = _iter_jsonl(path, json_key, advance)
        else:
            documents = _iter_text_file(path, advance)
        for lineno, text, error in documents:
            if error is None:
                try:
                    ids = tokenizer.tokenize(text)
                except UnicodeEncodeError as err:
                    error = f"text is not valid Unicode ({err.reason} at character {err.start})"
            if error is not None:
                message = f"{path}:{lineno}: {error}"
                summary.errors.append(message)
                if len(summary.errors) <= _MAX_LOGGED_ERRORS:
                    logger.warning("skipped %s", message)
                elif len(summary.errors) == _MAX_LOGGED_ERRORS + 1:
                    logger.warning("more malformed inputs; the summary lists them all")
                continue
            if len(ids) == 0:
                summary.empty_documents += 1
                logger.debug("skipped empty document %s:%d", path, lineno)
                continue
            tokens = numpy.asarray(list(ids) + eod, dtype=numpy.int64)
            if tokens.min() < 0 or tokens.max() >= vocab_size:
                raise ValueError(
                    f"{path}:{lineno}: the tokenizer produced an id outside [0, {vocab_size})"
                )
            builder.add_document(tokens, [tokens.size])
            summary.documents += 1
            summary.tokens += int(tokens.size)
            written()


def preprocess_files(
    paths: list[str],
    output_prefix: str,
    tokenizer,
    *,
    json_key: str = "text",
    append_eod: bool = False,
    strict: bool = False,
    progress: bool = True,
    log_interval: int | None = None,
) -> PreprocessSummary:
    """Tokenize `paths` into the Megatron dataset `<output_prefix>.bin` / `.idx`.

    Token ids are stored with `DType.optimal_dtype(tokenizer.vocab_size)` (uint16 below 65500 ids,
    else int32), as Megatron-LM's preprocess_data.py does; one sequence per document.

    Args:
        paths: input files, read in this order (see the module docstring for the formats).
        output_prefix: dataset path without extension; its directory is created.
        tokenizer: a `megatron_mea.data.tokenizers` tokenizer (or any Megatron legacy tokenizer).
        json_key: the field holding the text in JSON-lines files. Default: "text".
        append_eod: append `tokenizer.eod` to every document. Default: False.
        strict: on any malformed input, write nothing and raise `PreprocessError`. Default: False.
        progress: show a tqdm progress bar over input bytes (when tqdm is installed). Default: True.
        log_interval: log "processed N documents (docs/s, MB/s)" every `log_interval`
            documents, as Megatron-LM's tool prints them (`--log-interval`). Default: None
            (the progress bar only).

    Returns:
        The `PreprocessSummary`. If no document was written, nothing is published and
        `summary.written` is False (`summary.why_empty()` says why).

    Raises:
        FileNotFoundError: if an input does not exist (checked before anything is written).
        ValueError: if `output_prefix` ends in .bin/.idx, or the tokenizer yields an id outside
            [0, vocab_size).
        PreprocessError: in strict mode, when an input is malformed.
        OSError: an input that cannot be read; or the output's disk is full (its quota or a
            file-size limit reached): one line naming the output and the cause in plain
            words, the partial output removed.
    """
    if output_prefix.endswith((".bin", ".idx")):
        raise ValueError(
            f"--output-prefix {output_prefix!r} should not end in .bin/.idx: both files are written"
        )
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")

    summary = PreprocessSummary(output_prefix=output_prefix, files=list(paths))
    # Fetched once up front so a tokenizer without an eod token fails before any work.
    eod = [tokenizer.eod] if append_eod else []
    dtype = DType.optimal_dtype(tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = os.path.join(out_dir, f".{os.path.basename(output_prefix)}.tmp-{os.getpid()}")
    builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)

    total_bytes = sum(os.path.getsize(p) for p in paths)
    bar = None
    redirect = contextlib.nullcontext()
    if progress and tqdm is not None:
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess")
        # Routes the per-line warnings through tqdm.write, so they do not tear the bar apart.
        redirect = logging_redirect_tqdm()

    read, start = [0], time.monotonic()

    def advance(num_bytes: int) -> None:
        read[0] += num_bytes
        if bar is not None:
            bar.update(num_bytes)

    def written() -> None:
        if log_interval and summary.documents % log_interval == 0:
            elapsed = max(time.monotonic() - start, 1e-9)
            logger.info("processed %d documents (%.1f docs/s, %.2f MB/s)", summary.documents,
                        summary.documents / elapsed, read[0] / elapsed / 2 ** 20)

    published = False
    try:
        with redirect:
            _add_documents(builder, paths, tokenizer, json_key, eod, summary, advance, written)
        if strict and summary.errors and summary.documents:
            raise PreprocessError(summary)
        if summary.documents:
            builder.finalize(tmp_prefix + ".idx")
            _publish(tmp_prefix, output_prefix)
            published = summary.written = True
    except OSError as exc:
        cause = no_room_cause(exc, out_dir)
        if cause is None:
            raise
        raise OSError(f"{output_prefix}.bin/.idx: {cause}; nothing written (the partial "
                      "output was removed)") from exc
    finally:
        if bar is not None:
            bar.close()
        if not published:
            with contextlib.suppress(OSError):  # on a full disk, the close's flush fails too
                builder.data_file.close()
            for suffix in (".bin", ".idx"):
                if os.path.exists(tmp_prefix + suffix):
                    os.remove(tmp_prefix + suffix)

    if summary.errors:
        logger.warning("%d malformed input(s) skipped", len(summary.errors))
    return summary
