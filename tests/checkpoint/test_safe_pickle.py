"""`safe_pickle`: checkpoint pickles are read from admitted types only; a crafted one is refused
without running anything from it."""

import io
import os
import pickle
import random

import numpy
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from megatron_mea.checkpoint.torch_dist import integrity
from megatron_mea.checkpoint.torch_dist.safe_pickle import (
    UnsafePickleError,
    check_pickle,
    check_torch_save,
    load_pickle,
)


class _Payload:
    """Runs a shell command when unpickled (the attack)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_pickle_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps({"index": _Payload(marker)})
    for read in (check_pickle, load_pickle):
        with pytest.raises(UnsafePickleError, match=r"crafted: refused: it names (os|posix)\.system"):
            read(data, "crafted")
    assert not marker.exists()


def test_a_crafted_torch_save_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"rng_state": _Payload(marker)}, buffer)
    with pytest.raises(UnsafePickleError, match=r"refused: it names (os|posix)\.system"):
        check_torch_save(buffer.getvalue(), "common.pt")
    assert not marker.exists()
    with pytest.raises(UnsafePickleError, match=r"x.pt: not a torch.save archive"):
        check_torch_save(b"garbage", "x.pt")
    with pytest.raises(UnsafePickleError, match=r"x: not a readable pickle"):
        check_pickle(b"\x80\x04garbage", "x")


def test_what_checkpoints_hold_is_admitted():
    # The RNG state as the trainer saves it, and the optimizer / scheduler state types.
    state = dict(random=random.getstate(), numpy=numpy.random.get_state(),
                 torch=torch.get_rng_state(), tracker={"model-parallel-rng": torch.ones(3)},
                 groups=[{"params": [0, 1], "lr": 1e-3, "betas": (0.9, 0.95)}],
                 bf16=torch.zeros(2, dtype=torch.bfloat16), sizes=torch.Size([2, 3]))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    check_torch_save(buffer.getvalue(), "state")


def test_megatron_lm_argument_containers_are_admitted_as_pickle_names_them():
    # Pickle names a class by its __module__ (`_io.BytesIO`, not `io.BytesIO`).
    import argparse
    import pathlib
    import types

    args = argparse.Namespace(save=pathlib.PosixPath("/ckpt"), extra=types.SimpleNamespace(a=1),
                              buffer=io.BytesIO(b"x"))
    buffer = io.BytesIO()
    torch.save({"args": args}, buffer)
    check_torch_save(buffer.getvalue(), "common.pt")
    loaded = load_pickle(pickle.dumps(args), "args")
    assert loaded.save == args.save and loaded.buffer.getvalue() == b"x"


def test_a_torch_dist_index_loads_as_torch_reads_it(tmp_path):
    directory = str(tmp_path / "dcp")
    dcp_save({"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16),
              "extra": {"note": "bytes"}},
             storage_writer=FileSystemWriter(directory), no_dist=True)
    ours = integrity.read_index(directory)
    theirs = FileSystemReader(directory).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    integrity.scan_pickles(directory, ours)  # the byte object "extra.note" included
