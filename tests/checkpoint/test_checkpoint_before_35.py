"""A checkpoint written before issue 35 moved the checkpoint modules still loads, resumes and
converts, with the numbers it gave when it was written.

`tests/fixtures/checkpoint_before_35/run` is a `mea-pretrain` run (MEA, 2 layers, layer 2 MoE, Adam
state) saved at step 3 of 5 by main f9d1493; `expected.json` beside it holds what that code
computed from it (`tests/fixtures/make_checkpoint_before_35.py`, which also wrote it).
"""

import json
import os
import shutil

import pytest
import torch

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.torch_dist.safe_pickle import ALLOWED, check_pickle, check_torch_save
from tests._dist import run_distributed
from tests.fixtures.make_checkpoint_before_35 import (
    FIXTURE,
    RUN,
    _inference_logits,
    _pretrain,
    hf_logits,
)

RUN_DIR = os.path.join(FIXTURE, RUN)
SAVED = os.path.join(RUN_DIR, "iter_0000003")


@pytest.fixture(scope="module")
def expected():
    with open(os.path.join(FIXTURE, "expected.json"), encoding="utf-8") as handle:
        return json.load(handle)


def test_its_pickles_name_no_class_of_this_package():
    """Moving a module of megatron_mea cannot break the checkpoint: its pickles (the index and
    the common state) name only torch, numpy and standard-library globals (the safe loader's
    allow-list, which holds nothing of this package)."""
    assert not [entry for entry in ALLOWED if entry[0].startswith("megatron_mea")]
    with open(os.path.join(SAVED, ".metadata"), "rb") as handle:
        check_pickle(handle.read(), ".metadata")
    check_torch_save(os.path.join(SAVED, "common.pt"), "common.pt")


def test_inference_loading_gives_the_recorded_logits(expected):
    logits = run_distributed(_inference_logits, 1, RUN_DIR)[0]
    torch.testing.assert_close(torch.tensor(logits), torch.tensor(expected["inference_logits"]),
                               atol=1e-5, rtol=1e-5)


def test_a_resumed_run_continues_with_the_recorded_losses(expected, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(RUN_DIR, run)
    losses = run_distributed(_pretrain, 1, [*expected["train"], "--load", run, "--save", run])[0]
    assert losses == pytest.approx(expected["losses_after_resume"], rel=1e-5)
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as handle:
        assert [json.loads(line)["iteration"] for line in handle] == [1, 2, 3, 4, 5]


def test_the_hf_export_gives_the_recorded_logits(expected, tmp_path):
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(RUN_DIR, out) == expected["export_format"]
    torch.testing.assert_close(torch.tensor(hf_logits(out)), torch.tensor(expected["hf_logits"]),
                               atol=1e-5, rtol=1e-5)
