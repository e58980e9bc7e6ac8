"""`megatron_mea.runtime.files`: a file is replaced whole or not at all."""

import os

import pytest

from megatron_mea.runtime.files import atomic_write, no_room_cause, publish, temporary_name
from tests._limits import file_size_limit


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


def test_a_write_without_room_is_named_in_plain_words_however_the_writer_says_it(tmp_path):
    # Under a file-size limit each writer fails as it does on a full disk, and says it its own
    # way: Python's files with an errno, safetensors' Rust writer in its message, torch.save
    # with a short write ("unexpected pos N vs M", no errno: the cause is looked up).
    import errno

    import torch
    from safetensors.torch import save_file

    with file_size_limit(64):
        with pytest.raises(OSError) as python_error:
            with open(tmp_path / "a.bin", "wb") as handle:
                handle.write(bytes(1000))
        with pytest.raises(Exception, match=r"\(os error 27\)") as rust_error:
            save_file({"w": torch.zeros(1000)}, str(tmp_path / "b.safetensors"))
        with pytest.raises(RuntimeError, match=r"unexpected pos \d+ vs \d+") as torch_error:
            torch.save(torch.zeros(1000), str(tmp_path / "c.pt"))
        wrapped = RuntimeError("the save failed")  # as torch.distributed.checkpoint wraps it
        wrapped.__cause__ = torch_error.value
        causes = [no_room_cause(error, str(tmp_path / "out"))
                  for error in (python_error.value, rust_error.value, wrapped)]
    assert causes == ["file size limit reached (ulimit -f)"] * 3
    # The errno of a full disk and of a quota: plain words too.
    assert no_room_cause(OSError(errno.ENOSPC, "No space left on device"), "x") == "disk full"
    assert no_room_cause(OSError(errno.EDQUOT, "Disk quota exceeded"), "x") == (
        "disk quota exceeded")
    assert no_room_cause(RuntimeError("unrelated"), str(tmp_path)) is None
    assert no_room_cause(FileNotFoundError(errno.ENOENT, "No such file"), str(tmp_path)) is None
