"""`megatron_mea.files`: a file is replaced whole or not at all."""

import os

import pytest

from megatron_mea.files import atomic_write, publish, temporary_name


def test_atomic_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = str(tmp_path / "state.json")
    with open(path, "w") as handle:
        handle.write("old")
    with atomic_write(path) as handle:
        handle.write("new")
        assert open(path).read() == "old"  # nothing visible until the block ends
        assert os.path.exists(temporary_name(path))
    assert open(path).read() == "new"
    assert os.listdir(tmp_path) == ["state.json"]
    with atomic_write(path, "wb") as handle:
        handle.write(b"\x00\x01")
    assert open(path, "rb").read() == b"\x00\x01"


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "latest_checkpointed_iteration.txt")
    with open(path, "w") as handle:
        handle.write("3")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_write(path) as handle:
            handle.write("6")
            raise RuntimeError("killed mid-write")
    assert open(path).read() == "3"
    assert os.listdir(tmp_path) == ["latest_checkpointed_iteration.txt"]


def test_publish_moves_a_finished_file_over_the_target(tmp_path):
    finished, path = str(tmp_path / "data.bin.partial"), str(tmp_path / "data.bin")
    with open(finished, "wb") as handle:
        handle.write(b"payload")
    publish(finished, path)
    assert open(path, "rb").read() == b"payload" and not os.path.exists(finished)


def test_only_write_modes_are_taken(tmp_path):
    with pytest.raises(ValueError, match=r"mode \('a'\) must be 'w' or 'wb'"):
        with atomic_write(str(tmp_path / "x"), "a"):
            pass
