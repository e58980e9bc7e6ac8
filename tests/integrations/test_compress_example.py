"""`examples/mea_compress_continue.sh` follows the MEA paper's compression recipe, and
`mea-pretrain` accepts every flag it passes."""

import os
import shlex
import subprocess

import pytest

from megatron_mea.apps.training.arguments import parse_args

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mea_compress_continue.sh")


def _dry_run(**env):
    result = subprocess.run(
        ["bash", SCRIPT], env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True,
        text=True, timeout=60, check=True,
    )
    return result.stdout.splitlines()


def _flags(command: list) -> dict:
    """`--flag value` pairs of a command (switches map to True)."""
    flags, i = {}, 0
    while i < len(command):
        if command[i].startswith("--"):
            has_value = i + 1 < len(command) and not command[i + 1].startswith("--")
            flags[command[i]] = command[i + 1] if has_value else True
            i += 2 if has_value else 1
        else:
            i += 1
    return flags


def test_the_script_follows_the_papers_numbers():
    lines = _dry_run(LAYERS="paper-half")
    # 22B tokens at 16384 x 4096 tokens per step; 1,000 warm-up steps do not fit in 328 steps.
    assert lines[0] == ("schedule: 328 steps of 67108864 tokens, warm-up 32, LR 1.6e-5 cosine "
                        "to 0")
    compress = shlex.split(next(line for line in lines if " compress " in line))
    assert _flags(compress)["--layers"] == "paper-half"
    assert _flags(compress)["--num-kv-components"] == "2"
    pretrain = shlex.split(next(line for line in lines if line.startswith("torchrun")))
    flags = _flags(pretrain[pretrain.index("megatron_mea.cli.pretrain") + 1:])
    assert flags["--lr"] == "1.6e-5" and flags["--min-lr"] == "0"
    assert flags["--lr-decay-style"] == "cosine" and flags["--lr-warmup-iters"] == "32"
    assert int(flags["--global-batch-size"]) * int(flags["--seq-length"]) == 67108864
    assert flags["--weight-decay"] == "0.1"


def test_a_long_recovery_stage_warms_up_over_the_papers_1000_steps():
    lines = _dry_run(TRAIN_TOKENS=str(10**12))
    assert lines[0].startswith("schedule: 14902 steps") and "warm-up 1000" in lines[0]


def test_mea_pretrain_accepts_the_scripts_flags(monkeypatch):
    lines = _dry_run()
    command = shlex.split(next(line for line in lines if line.startswith("torchrun")))
    flags = command[command.index("megatron_mea.cli.pretrain") + 1:]
    # The model comes from the compressed checkpoint's config.yaml; stand in a tiny MoE model
    # (8 experts for EP=8) and mock data for what exists only on the cluster.
    dropped = {"--config", "--load", "--data-path", "--tokenizer-type",
               "--tokenizer-model"}
    kept, i = [], 0
    while i < len(flags):
        if flags[i] in dropped:
            i += 2
            continue
        kept.append(flags[i])
        i += 1
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_args([*kept, "--mock-data", "--num-layers", "2", "--hidden-size", "64",
                       "--num-attention-heads", "4", "--num-experts", "8"])
    assert args.warmup_iters == 32 and args.train_iters == 328
