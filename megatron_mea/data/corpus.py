"""A real-text corpus that needs no download: the Python standard library on this machine.

Documents come, in this fixed order, from:

1. `pydoc_data.topics.topics`: the text of the Python language reference topics (what `help()`
   shows), one document per topic, sorted by topic name;
2. the standard library's `.py` sources, sorted by path, without test suites and site-packages;
3. small text files under /usr/share/doc (README, changelog, NEWS, copyright...; gzipped ones
   are decompressed with a size cap), sorted by path, identical texts kept once. They come last
   because they vary most between machines and are mostly packaging changelogs, so a `max_bytes`
   budget is spent on Python text first.

The result depends on the Python build and the installed system packages, but is byte-identical
between runs on one machine.
"""

import gzip
import hashlib
import json
import logging
import os
import sysconfig

from megatron_mea.runtime.files import atomic_write

logger = logging.getLogger(__name__)

SYSTEM_DOC_DIR = "/usr/share/doc"

# Larger files under /usr/share/doc are mostly generated changelogs or data; small ones are prose.
_MAX_DOC_FILE_BYTES = 256 * 1024
_DOC_NAME_PREFIXES = ("readme", "changelog", "changes", "news", "copyright", "authors", "history")
_SKIPPED_STDLIB_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
}


def _topic_documents():
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship Python without pydoc_data
        logger.info("pydoc_data.topics is not available; the corpus has no Python docs text")
        return
    for name in sorted(topics):
        yield f"python-docs:{name}", topics[name]


def _read_small_text(path: str) -> str | None:
    """The UTF-8 text of `path` (gunzipped if .gz) if it is small and not binary, else None."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as stream:
                # Reading one byte past the cap bounds memory on a hostile or huge archive.
                data = stream.read(_MAX_DOC_FILE_BYTES + 1)
        else:
            if os.path.getsize(path) > _MAX_DOC_FILE_BYTES:
                return None
            with open(path, "rb") as stream:
                data = stream.read(_MAX_DOC_FILE_BYTES + 1)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if len(data) > _MAX_DOC_FILE_BYTES or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _system_doc_documents(doc_dir: str):
    if not os.path.isdir(doc_dir):
        return
    seen = set()
    for root, dirs, files in os.walk(doc_dir):
        dirs.sort()
        for name in sorted(files):
            stem = name[:-3] if name.endswith(".gz") else name
            if not stem.lower().startswith(_DOC_NAME_PREFIXES):
                continue
            path = os.path.join(root, name)
            text = _read_small_text(path)
            if not text or not text.strip():
                continue
            # Most packages ship the same license texts; repeating them would skew the corpus.
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if digest in seen:
                continue
            seen.add(digest)
            yield f"system-doc:{os.path.relpath(path, doc_dir)}", text


def _stdlib_source_documents(stdlib_dir: str):
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_STDLIB_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as stream:
                    text = stream.read().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                # A few stdlib files are deliberately in other encodings; not worth a guess.
                logger.debug("skipped %s: unreadable or not UTF-8", path)
                continue
            if text.strip():
                yield f"python-stdlib:{os.path.relpath(path, stdlib_dir)}", text


def iter_stdlib_corpus(stdlib_dir: str | None = None, doc_dir: str = SYSTEM_DOC_DIR):
    """Yield (source, text) for every corpus document, in the fixed order of the module docstring.

    Args:
        stdlib_dir: the standard library directory. Default: `sysconfig.get_paths()["stdlib"]`.
        doc_dir: the system documentation directory. Default: /usr/share/doc.
    """
    stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
    yield from _topic_documents()
    yield from _stdlib_source_documents(stdlib_dir)
    yield from _system_doc_documents(doc_dir)


def build_stdlib_corpus(
    output_jsonl: str, max_documents: int | None = None, max_bytes: int | None = None
) -> tuple[int, int]:
    """Write the standard-library corpus as JSON lines: {"text": ..., "source": ...} per document.

    The file is written all or nothing (`megatron_mea.runtime.files.atomic_write`).

    Args:
        output_jsonl: path of the JSON-lines file to write; its directory is created.
        max_documents: stop after this many documents. Default: None (no limit).
        max_bytes: stop before the UTF-8 text would exceed this many bytes (the JSON framing is
            not counted). Default: None (no limit).

    Returns:
        (documents written, UTF-8 bytes of text written).
    """
    os.makedirs(os.path.dirname(os.path.abspath(output_jsonl)), exist_ok=True)
    documents = num_bytes = 0
    with atomic_write(output_jsonl) as out:
        for source, text in iter_stdlib_corpus():
            if max_documents is not None and documents >= max_documents:
                break
            size = len(text.encode("utf-8"))
            if max_bytes is not None and num_bytes + size > max_bytes:
                break
            # ensure_ascii keeps each line plain ASCII, so any reader decodes it the same way.
            out.write(json.dumps({"text": text, "source": source}) + "\n")
            documents += 1
            num_bytes += size
    logger.info("wrote %d documents (%d bytes of text) to %s", documents, num_bytes, output_jsonl)
    return documents, num_bytes
