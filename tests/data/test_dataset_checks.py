"""Damaged `.bin/.idx` files and splits without documents are refused naming the file or the
split, before Megatron reads them (a split without documents used to hang forever)."""

import json
import os
import subprocess
import sys

import pytest

from megatron_mea.data import ByteLevelTokenizer, DatasetError, preprocess_files
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


def test_a_split_without_documents_is_refused_naming_it_and_the_counts(prefix):
    with pytest.raises(DatasetError, match=r"--split 969,30,1: the valid split of .*ds gets 0 of "
                                           r"its 5 documents \(train 5, valid 0, test 0\)"):
        check_splits(prefix, 5, "969,30,1")


def test_building_a_tiny_split_fails_instead_of_hanging(prefix):
    # Megatron alone loops forever sizing the epochs of a split with no document: run it in a
    # process of its own so that a hang is a failure, not a stuck test session.
    code = (
        "import sys\n"
        "from megatron_mea.data import ByteLevelTokenizer, DatasetError, build_gpt_datasets\n"
        "try:\n"
        f"    build_gpt_datasets([{prefix!r}], '969,30,1', 16, ByteLevelTokenizer(), 8, 0, 0,"
        " 1, False)\n"
        "except DatasetError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    assert "the valid split" in run.stdout and "gets 0 of its 5 documents" in run.stdout
