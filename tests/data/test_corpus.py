"""The standard-library corpus: real text, deterministic, and it preprocesses cleanly end to end."""

import json

from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_mea.data import ByteLevelTokenizer, build_stdlib_corpus, preprocess_files

BUDGET = 1_200_000


def test_corpus_is_over_a_megabyte_and_byte_identical_across_runs(tmp_path):
    first, second = tmp_path / "a" / "corpus.jsonl", tmp_path / "b" / "corpus.jsonl"
    counts = build_stdlib_corpus(str(first), max_bytes=BUDGET)
    assert build_stdlib_corpus(str(second), max_bytes=BUDGET) == counts
    assert first.read_bytes() == second.read_bytes()

    documents, num_bytes = counts
    assert 1_000_000 < num_bytes <= BUDGET and documents > 10
    records = [json.loads(line) for line in first.read_text().splitlines()]
    assert len(records) == documents
    assert sum(len(r["text"].encode()) for r in records) == num_bytes
    assert all(set(r) == {"text", "source"} and r["text"].strip() for r in records)
    sources = [r["source"] for r in records]
    assert len(set(sources)) == len(sources)
    assert any(s.startswith("python-stdlib:") for s in sources)
    assert not any("site-packages" in s or "/test/" in s for s in sources)


def test_max_documents_and_end_to_end_preprocessing(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    documents, num_bytes = build_stdlib_corpus(str(corpus), max_documents=25)
    assert documents == 25
    summary = preprocess_files(
        [str(corpus)], str(tmp_path / "ds"), ByteLevelTokenizer(), append_eod=True, progress=False
    )
    # Byte-level tokens: one per UTF-8 byte, plus one eod per document.
    assert (summary.documents, summary.tokens, summary.errors) == (25, num_bytes + 25, [])
    assert len(IndexedDataset(str(tmp_path / "ds"))) == 25
