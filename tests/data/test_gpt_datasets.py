"""build_gpt_datasets: Megatron GPT datasets over our preprocessed files, and mock data, on CPU.

Megatron builds them without torch.distributed, except a blend with a cache directory, which the
last test covers under the one-rank gloo group of `single_rank`.
"""

import json
import os

import numpy
import pytest
import torch

from megatron_mea.data import (ByteLevelTokenizer, DatasetSettings, build_gpt_datasets,
                               preprocess_files)
from tests._dist import run_distributed

SEQ = 16


@pytest.fixture(scope="module")
def tok():
    return ByteLevelTokenizer()


def _make_dataset(directory, tok, texts, name="ds"):
    jsonl = directory / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(directory / name)
    preprocess_files([str(jsonl)], prefix, tok, append_eod=True, progress=False)
    return prefix


def _assert_sample(sample, vocab_size):
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids"}
    assert "attention_mask" not in sample
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert sample[key].shape == (SEQ,), key
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["tokens"].max()) < vocab_size and int(sample["tokens"].min()) >= 0


def test_samples_are_windows_of_the_document_stream(tmp_path, tok):
    # One document, so every sample is a window of (doc + eod) repeated over epochs.
    text = "The quick brown fox jumps over the lazy dog. " * 3
    prefix = _make_dataset(tmp_path, tok, [text])
    train, valid, test = build_gpt_datasets(DatasetSettings(
        data_prefix=[prefix], split="1,0,0", seq_length=SEQ, train_samples=20, seed=3,
        cache_dir=str(tmp_path / "c")), tok)
    assert valid is None and test is None
    assert len(train) >= 20
    stream = (list(text.encode()) + [tok.eod]) * 4
    for i in range(len(train)):
        sample = train[i]
        _assert_sample(sample, tok.vocab_size)
        window = sample["tokens"].tolist() + [int(sample["labels"][-1])]
        assert any(stream[j : j + SEQ + 1] == window for j in range(len(stream) - SEQ)), i


def test_split_and_weighted_blend_without_distributed(tmp_path, tok):
    assert not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    docs_a = [f"document a{i} " * (5 + i % 7) for i in range(60)]
    docs_b = [f"B{i} " * (3 + i % 5) for i in range(60)]
    prefix_a = _make_dataset(tmp_path, tok, docs_a, "a")
    prefix_b = _make_dataset(tmp_path, tok, docs_b, "b")

    train, valid, test = build_gpt_datasets(DatasetSettings(
        data_prefix=["0.7", prefix_a, "0.3", prefix_b], split="8,2,0", seq_length=SEQ,
        train_samples=40, valid_samples=8, test_samples=0, seed=1), tok)
    assert test is None
    assert len(train) >= 40 and len(valid) >= 8  # per-dataset counts are rounded up
    ids = numpy.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    # BlendedDataset draws datasets greedily in proportion to the weights.
    assert abs((ids == 0).mean() - 0.7) < 0.1
    for dataset in (train, valid):
        _assert_sample(dataset[0], tok.vocab_size)


def test_same_seed_same_samples(tmp_path, tok):
    prefix = _make_dataset(tmp_path, tok, [f"doc {i} " * (2 + i % 9) for i in range(40)])
    a, b = (build_gpt_datasets(DatasetSettings(
        data_prefix=[prefix], split="1,0,0", seq_length=SEQ, train_samples=10, seed=7,
        cache_dir=str(tmp_path / cache)), tok) for cache in ("1", "2"))
    for i in range(10):
        assert torch.equal(a[0][i]["tokens"], b[0][i]["tokens"])


def test_mock_datasets_have_the_right_shapes(tok):
    train, valid, test = build_gpt_datasets(DatasetSettings(
        split="98,2,0", seq_length=SEQ, train_samples=8, valid_samples=4, test_samples=4, seed=1,
        mock=True), tok)
    for dataset in (train, valid, test):
        assert len(dataset) >= 4
        _assert_sample(dataset[0], tok.vocab_size)


def test_optional_attention_mask(tok):
    train, _, _ = build_gpt_datasets(DatasetSettings(
        split="1,0,0", seq_length=SEQ, train_samples=2, valid_samples=1, test_samples=1, seed=1,
        mock=True, create_attention_mask=True), tok)
    assert train[0]["attention_mask"].shape == (1, SEQ, SEQ)


def test_argument_errors_name_the_flags(tmp_path, tok):
    def build(data_prefix, mock, valid_samples=1, test_samples=1):
        build_gpt_datasets(DatasetSettings(
            data_prefix=data_prefix, split="1,0,0", seq_length=SEQ, train_samples=1,
            valid_samples=valid_samples, test_samples=test_samples, seed=1, mock=mock), tok)

    with pytest.raises(ValueError, match="--mock-data"):
        build(["x"], mock=True)
    with pytest.raises(ValueError, match="--data-path"):
        build(None, mock=False)
    with pytest.raises(ValueError, match="valid_samples, test_samples must be a number"):
        build(["1", "a", "2", "b"], mock=False, valid_samples=None, test_samples=None)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        build([str(tmp_path / "missing")], mock=False)


def _blend_without_process_group(rank, world_size, prefixes, cache):
    """In a fresh process, where torch.distributed was never initialised."""
    assert not torch.distributed.is_initialized()
    try:
        build_gpt_datasets(DatasetSettings(
            data_prefix=prefixes, split="1,0,0", seq_length=SEQ, train_samples=2,
            valid_samples=0, test_samples=0, seed=1, cache_dir=cache), ByteLevelTokenizer())
    except RuntimeError as exc:
        return str(exc)
    return None


def test_blend_with_cache_dir_needs_a_process_group(tmp_path, tok):
    prefix_a = _make_dataset(tmp_path, tok, ["x " * 9], "a")
    prefix_b = _make_dataset(tmp_path, tok, ["y " * 9], "b")
    (error,) = run_distributed(
        _blend_without_process_group, 1, [prefix_a, prefix_b], str(tmp_path)
    )
    assert error is not None and "torch.distributed" in error


def test_blend_with_cache_dir_under_one_rank_group(tmp_path, tok, single_rank):
    prefix_a = _make_dataset(tmp_path, tok, [f"x{i} " * 9 for i in range(30)], "a")
    prefix_b = _make_dataset(tmp_path, tok, [f"y{i} " * 9 for i in range(30)], "b")
    cache = tmp_path / "cache"
    train, _, _ = build_gpt_datasets(DatasetSettings(
        data_prefix=["0.5", prefix_a, "0.5", prefix_b], split="1,0,0", seq_length=SEQ,
        train_samples=20, valid_samples=0, test_samples=0, seed=1, cache_dir=str(cache)), tok)
    _assert_sample(train[0], tok.vocab_size)
    assert any(p.name.endswith("dataset_index.npy") for p in cache.iterdir())


def test_data_regenerated_at_the_same_prefix_rebuilds_the_cached_indices(tmp_path, tok):
    # Megatron keys its cached sample indices by the settings only; the data's identity (the
    # .idx content and the .bin size) is part of the key, so new data is never read through the
    # old data's offsets.
    cache = str(tmp_path / "cache")
    build = lambda prefix, cache_dir: build_gpt_datasets(DatasetSettings(  # noqa: E731
        data_prefix=[prefix], split="1,0,0", seq_length=SEQ, train_samples=40, seed=5,
        cache_dir=cache_dir), tok)
    prefix = _make_dataset(tmp_path, tok, [f"old document {i} " * (4 + i % 9) for i in range(80)])
    build(prefix, cache)
    first_files = set(os.listdir(cache))
    _make_dataset(tmp_path, tok, [f"NEW {i} " * (2 + i % 3) for i in range(12)])
    again = build(prefix, cache)[0]
    fresh = build(prefix, str(tmp_path / "fresh"))[0]
    assert len(again) == len(fresh)
    for i in range(len(fresh)):
        assert torch.equal(again[i]["tokens"], fresh[i]["tokens"]), i
    assert set(os.listdir(cache)) > first_files  # new index files beside the old ones
