"""Bad `mea-pretrain` inputs are refused before any model is built: one line naming the flag or
the file, exit status 2 (1 is kept for failures at run time)."""

import json
import re

import pytest

from megatron_mea.cli.pretrain import main
from megatron_mea.data import ByteLevelTokenizer, preprocess_files
from tests._dist import standalone_environment

MOCK = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-experts", "4", "--no-progress-bar"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    jsonl = directory / "ds.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(5)))
    prefix = str(directory / "ds")
    preprocess_files([str(jsonl)], prefix, ByteLevelTokenizer(), append_eod=True, progress=False)
    return prefix


def _refused(argv, capsys):
    """(exit status, the one `mea-pretrain: error:` line); no traceback."""
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("mea-pretrain: error:")]
    assert len(lines) == 1, err
    return status, lines[0]


@pytest.mark.parametrize("flags,match", [
    (["--lr", "-1"], r"lr \(-1.0\) must be >= 0"),
    (["--adam-beta1", "1.5"], r"adam_beta1 \(1.5\) must be in \[0, 1\)"),
    (["--moe-router-topk", "8"], r"moe_router_topk \(8\) must be in \[1, num_experts \(4\)\]"),
    (["--split", "a,b"], r"split \('a,b'\) must be up to three numbers"),
    (["--seq-length", "128", "--max-position-embeddings", "64"],
     r"seq_length \(128\) must not exceed max_position_embeddings \(64\)"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/no/such/tokenizer"],
     r"tokenizer_model: no such file or directory '/no/such/tokenizer'"),
    (["--ckpt-step", "3"], r"ckpt_step \(3\) needs load"),
    (["--distributed-timeout-minutes", "0"], r"distributed_timeout_minutes \(0.0\) must be > 0"),
])
def test_bad_flags_are_refused_in_one_line(flags, match, capsys):
    status, line = _refused([*MOCK, *flags], capsys)
    assert status == 2
    assert re.search(match, line), line


def test_moe_with_tensor_parallelism_needs_sequence_parallelism(monkeypatch, capsys):
    # Megatron-Core's MoE layer would refuse it only at the first forward, after the build.
    monkeypatch.setenv("WORLD_SIZE", "2")
    status, line = _refused([*MOCK, "--tensor-model-parallel-size", "2"], capsys)
    assert status == 2
    assert re.search(r"num_experts \(4\) with tensor_model_parallel_size \(2\) > 1 needs "
                     r"sequence_parallel \(--sequence-parallel\)", line), line


def test_bad_config_files_are_named(tmp_path, capsys):
    missing = str(tmp_path / "missing.yaml")
    status, line = _refused(["--config", missing], capsys)
    assert status == 2 and f"{missing}: cannot read the config" in line
    broken = tmp_path / "broken.yaml"
    broken.write_text("lr: 1e-3\nhidden-size: [64\n")
    status, line = _refused(["--config", str(broken)], capsys)
    assert status == 2 and f"{broken}: not valid YAML at line" in line


def test_damaged_data_and_a_split_without_documents_are_named(dataset, tmp_path, capsys):
    data = ["--num-layers", "2", "--no-progress-bar", "--data-path"]
    status, line = _refused([*data, dataset], capsys)  # 969,30,1 of 5 documents
    assert status == 2
    assert "the valid split of" in line and "gets 0 of its 5 documents" in line
    empty = str(tmp_path / "empty")
    for suffix in (".bin", ".idx"):
        with open(dataset + suffix, "rb") as src, open(empty + suffix, "wb") as dst:
            dst.write(src.read() if suffix == ".idx" else b"")
    status, line = _refused([*data, empty, "--split", "1,0,0"], capsys)
    assert status == 2 and f"{empty}.bin: truncated or empty (0 bytes" in line


def test_data_of_a_larger_vocabulary_is_refused_before_the_model_is_built(dataset, tmp_path):
    import subprocess
    import sys

    import numpy

    largest = int(numpy.fromfile(dataset + ".bin", dtype=numpy.uint16).max())
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "megatron_mea.cli.pretrain", "--num-layers", "2",
               "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "0",
               "--no-progress-bar", "--data-path", dataset, "--split", "1,0,0",
               "--vocab-size", str(largest), "--data-cache-path", str(cache),
               "--train-iters", "1", "--eval-iters", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=standalone_environment())
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("mea-pretrain: error:")]
    assert f"{dataset}.bin holds token id {largest}, the model's vocabulary has {largest} ids" \
        in line
    # The scan is cached with the run's data cache, and one more id is enough.
    assert (cache / "max_token_ids.json").exists()
    command[command.index("--vocab-size") + 1] = str(largest + 1)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=standalone_environment())
    assert result.returncode == 0, result.stderr[-3000:]


def test_generate_refuses_an_empty_prompt_before_loading(tmp_path, capsys):
    from megatron_mea.cli.generate import main as generate

    with pytest.raises(SystemExit) as exited:  # argparse's usage error: status 2
        generate(["--load", str(tmp_path / "nothing-here"), "--prompt", "Hi", "--prompt", ""])
    assert exited.value.code == 2
    assert "prompt 1 is empty: a prompt needs at least one token" in capsys.readouterr().err


@pytest.mark.slow
def test_the_dataset_index_cache_goes_into_the_run_directory(dataset, tmp_path):
    """Read-only data trains: the index caches are written under --save (data_cache/), not next
    to the data, unless --data-cache-path says otherwise."""
    import os
    import shutil
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(dataset + suffix, data / ("ds" + suffix))
    save = tmp_path / "run"
    command = [sys.executable, "-m", "megatron_mea.cli.pretrain", "--num-layers", "2",
               "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "0",
               "--no-progress-bar", "--data-path", str(data / "ds"), "--split", "1,0,0",
               "--train-iters", "1", "--eval-iters", "0", "--save", str(save)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=standalone_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(data)) == ["ds.bin", "ds.idx"]  # nothing written next to the data
    assert any((save / "data_cache").rglob("*.npy")), sorted(save.rglob("*"))


def test_data_that_cannot_hold_its_cache_is_refused_with_a_hint(dataset, monkeypatch):
    # Without --save or --data-cache-path the cache goes next to the data: its folder must be
    # writable (os.access answers True for root whatever the mode, so the answer is set here).
    import os

    from megatron_mea.apps.training import arguments
    from megatron_mea.apps.training.arguments import PretrainArgs, validate

    folder = os.path.dirname(dataset)
    monkeypatch.setattr(arguments.os, "access", lambda path, mode: path != folder)
    args = PretrainArgs(data_path=[dataset], num_layers=2, hidden_size=64,
                        num_attention_heads=4, split="1,0,0")
    with pytest.raises(ValueError, match=rf"^data_path {dataset}: {folder} is not writable for "
                                         r"the dataset index cache; pass --data-cache-path DIR"):
        validate(args)
    validate(PretrainArgs(**{**vars(args), "data_cache_path": "cache"}))
    validate(PretrainArgs(**{**vars(args), "save": "run"}))
    assert "the dataset index caches" in arguments.build_parser().format_help()  # --help says it
