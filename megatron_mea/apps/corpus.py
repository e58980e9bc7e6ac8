"""The dataset of the demo-scale runs (`mea-demo`, `mea-lr-sweep`'s cpu preset, `mea-reproduce`):
the Python standard library's source and documentation on this machine, tokenized byte by byte
into `<out>/data`. Its progress line is an INFO record of this module's logger.
"""

import json
import logging
import os
import shutil

from megatron_mea.runtime.files import atomic_write

logger = logging.getLogger(__name__)


def prepare_data(out: str, max_bytes: int) -> str:
    """Corpus -> `.bin/.idx`; returns the dataset prefix. Kept from an earlier demo built with
    the same `max_bytes`; otherwise `<out>/data` is built anew (Megatron's index cache there
    included: it is keyed by the path, not by the contents)."""
    from megatron_mea.data import build_stdlib_corpus, build_tokenizer, preprocess_files

    data = os.path.join(out, "data")
    prefix = os.path.join(data, "stdlib_text_document")
    record = os.path.join(data, "corpus.json")
    if os.path.exists(prefix + ".idx") and os.path.exists(record):
        with open(record, encoding="utf-8") as handle:
            built = json.load(handle)
        if built["max_bytes"] == max_bytes:
            logger.info("[demo] data: %d documents, %d tokens, kept from an earlier demo "
                        "(%s.bin/.idx)", built["documents"], built["tokens"], prefix)
            return prefix
    shutil.rmtree(data, ignore_errors=True)
    corpus = os.path.join(data, "stdlib_corpus.jsonl")
    os.makedirs(data)
    documents, size = build_stdlib_corpus(corpus, max_bytes=max_bytes)
    summary = preprocess_files(
        [corpus], prefix, build_tokenizer("ByteLevelTokenizer"), append_eod=True
    )
    with atomic_write(record) as handle:  # last: a demo killed before it rebuilds the data
        json.dump({"max_bytes": max_bytes, "documents": summary.documents,
                   "tokens": summary.tokens}, handle)
    logger.info("[demo] data: %d documents, %.1f MiB of stdlib source and docs, %d tokens "
                "(%s.bin/.idx)", documents, size / 2**20, summary.tokens, prefix)
    return prefix
