"""Damaged `.bin/.idx` files and splits without documents are refused naming the file or the
split, before Megatron reads them (a split without documents used to hang forever, and so did an
index whose lengths were overwritten with random bytes behind an intact header)."""

import json
import os
import re
import subprocess
import sys

import numpy
import pytest

from megatron_mea.data import ByteLevelTokenizer, DatasetError, preprocess_files
from megatron_mea.data import checks
from megatron_mea.data.checks import check_dataset_files, check_splits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def prefix(tmp_path):
    jsonl = tmp_path / "ds.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(5)))
    prefix = str(tmp_path / "ds")
    preprocess_files([str(jsonl)], prefix, ByteLevelTokenizer(), append_eod=True, progress=False)
    return prefix


def test_a_good_dataset_passes_and_counts_its_documents(prefix):
    assert check_dataset_files(prefix) == 5
    check_splits(prefix, 5, "3,1,1")


@pytest.mark.parametrize("damage,match", [
    ("empty idx", r"ds.idx: empty or truncated \(0 bytes"),
    ("truncated idx", r"ds.idx: truncated \(40 bytes, its header needs \d+\)"),
    ("foreign idx", r"ds.idx: not a Megatron .idx file \(bad header\)"),
    ("empty bin", r"ds.bin: truncated or empty \(0 bytes, its index .*ds.idx needs \d+\)"),
    ("truncated bin", r"ds.bin: truncated or empty \(10 bytes"),
])
def test_damaged_files_are_named(prefix, damage, match):
    kind, suffix = damage.split()
    path = prefix + "." + suffix
    with open(path, "r+b") as handle:
        if kind == "foreign":
            handle.write(b"not an index at all, but long enough to have a header")
        else:
            handle.truncate({"empty": 0, "truncated": 40 if suffix == "idx" else 10}[kind])
    with pytest.raises(DatasetError, match=match):
        check_dataset_files(prefix)


def _entries(prefix):
    """The index's lengths, pointers and document indices, writable in place (5 documents of
    one sequence each, behind the 34-byte header)."""
    path = prefix + ".idx"
    return (numpy.memmap(path, dtype=numpy.int32, mode="r+", offset=34, shape=(5,)),
            numpy.memmap(path, dtype=numpy.int64, mode="r+", offset=34 + 4 * 5, shape=(5,)),
            numpy.memmap(path, dtype=numpy.int64, mode="r+", offset=34 + 12 * 5, shape=(6,)))


def _random_lengths(lengths):
    # Random bytes over the lengths, header and last length intact (the old check read only
    # those); the variant on which Megatron loops forever sizing its epochs is the one whose
    # lengths sum below zero: the first seed giving one.
    for seed in range(100):
        garbage = numpy.frombuffer(numpy.random.default_rng(seed).bytes(4 * 5), numpy.int32)
        garbage = numpy.append(garbage[:-1], lengths[-1])
        if garbage.astype(numpy.int64).sum() < 0:
            lengths[:] = garbage
            return


@pytest.mark.parametrize("damage,match", [
    ("random lengths", r"ds.idx: damaged index: sequence \d of 5 has length -\d+ \(negative\)"),
    ("negative length", r"ds.idx: damaged index: sequence 2 of 5 has length -3 \(negative\)"),
    ("huge length", r"ds.idx: damaged index: sequence 3 of 5 starts at byte \d+, but sequence 2 "
                    r"\(length 100000000\) ends at byte 200\d+"),
    ("shifted pointer", r"ds.idx: damaged index: sequence 2 of 5 starts at byte \d+, but sequence "
                        r"1 \(length \d+\) ends at byte \d+"),
    ("first pointer", r"ds.idx: damaged index: sequence 0 of 5 starts at byte 8, but the first "
                      r"sequence starts at 0"),
    ("falling document index", r"ds.idx: damaged index: document index 3 of 6 is 1, below the "
                               r"one before it \(2\)"),
    ("last document index", r"ds.idx: damaged index: its last document index is 4, expected the "
                            r"sequence count 5"),
    ("huge last length", r"ds.bin: truncated or empty \(\d+ bytes, its index .*ds.idx needs "),
])
def test_damaged_index_entries_are_named_with_the_first_bad_one(prefix, damage, match):
    # The damage lands in the middle of the index, behind an intact header, as a bad disk,
    # a crashed writer or a wrong copy leave it.
    lengths, pointers, documents = _entries(prefix)
    {"random lengths": lambda: _random_lengths(lengths),
     "negative length": lambda: lengths.__setitem__(2, -3),
     "huge length": lambda: lengths.__setitem__(2, 10 ** 8),
     "shifted pointer": lambda: pointers.__setitem__(2, pointers[2] + 1000),
     "first pointer": lambda: pointers.__setitem__(0, 8),
     "falling document index": lambda: documents.__setitem__(3, 1),
     "last document index": lambda: documents.__setitem__(5, 4),
     "huge last length": lambda: lengths.__setitem__(4, 10 ** 8)}[damage]()
    for array in (lengths, pointers, documents):
        array.flush()
    with pytest.raises(DatasetError, match=match):
        check_dataset_files(prefix)


def test_the_index_check_runs_once_per_file_version(prefix, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    assert check_dataset_files(prefix, str(cache)) == 5
    # A new process (an empty memo) reads the cache instead of checking again...
    monkeypatch.setattr(checks, "_CHECKED", {})
    monkeypatch.setattr(checks, "_check_entries", lambda *args: pytest.fail("checked again"))
    assert check_dataset_files(prefix, str(cache)) == 5
    monkeypatch.undo()
    # ...while the same file damaged in place (same size, a new modification time) is checked.
    lengths, _, _ = _entries(prefix)
    lengths[2] = -3
    lengths.flush()
    os.utime(prefix + ".idx", ns=(1, 1))
    with pytest.raises(DatasetError, match="sequence 2 of 5 has length -3"):
        check_dataset_files(prefix, str(cache))


# mea-pretrain's command line on a damaged index: one release (the checks run on both).
@pytest.mark.one_release("0.16")
def test_mea_pretrain_refuses_a_damaged_index_in_one_line(prefix, capsys, tool_logging):
    # The variant that hung mea-pretrain forever with no output (Megatron's epoch sizing loops
    # on a negative token count), refused before any process group or index build.
    from megatron_mea.cli.pretrain import main

    lengths, _, _ = _entries(prefix)
    _random_lengths(lengths)
    lengths.flush()
    status = main(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                   "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
                   "--train-iters", "2", "--data-path", prefix, "--split", "1,0,0",
                   "--tokenizer-type", "ByteLevelTokenizer"])
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in out + err
    assert re.fullmatch(rf"mea-pretrain: error: {re.escape(prefix)}.idx: damaged index: sequence "
                        r"\d of 5 has length -\d+ \(negative\)\n", err), err


def test_a_split_without_documents_is_refused_naming_it_and_the_counts(prefix):
    with pytest.raises(DatasetError, match=r"--split 969,30,1: the valid split of .*ds gets 0 of "
                                           r"its 5 documents \(train 5, valid 0, test 0\)"):
        check_splits(prefix, 5, "969,30,1")


def test_building_a_tiny_split_fails_instead_of_hanging(prefix):
    # Megatron alone loops forever sizing the epochs of a split with no document: run it in a
    # process of its own so that a hang is a failure, not a stuck test session.
    code = (
        "import sys\n"
        "from megatron_mea.data import (ByteLevelTokenizer, DatasetError, DatasetSettings,\n"
        "                               build_gpt_datasets)\n"
        "try:\n"
        f"    build_gpt_datasets(DatasetSettings(data_prefix=[{prefix!r}], split='969,30,1',"
        " seq_length=16, train_samples=8, valid_samples=0, test_samples=0, seed=1),"
        " ByteLevelTokenizer())\n"
        "except DatasetError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    assert "the valid split" in run.stdout and "gets 0 of its 5 documents" in run.stdout
