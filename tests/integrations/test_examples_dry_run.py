"""Every example's argument set parses and validates in dry-run mode (no GPU, no Megatron-LM)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mea.cli.dry_run import main
from megatron_mea.integrations.dry_run import DryRunError, dry_run

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "megatron_lm"
SIZE_LINE = re.compile(r"params: ([0-9.]+)B total, ([0-9.]+)B active.*KV cache (\d+) B/token")


def run_example(script, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environ.update(DRY_RUN="1", PYTHON=sys.executable, PYTHONWARNINGS="ignore",
                   PYTHONPATH=str(REPO), **env)
    return subprocess.run(["bash", str(EXAMPLES / script)], env=environ, capture_output=True,
                          text=True, timeout=120)


CASES = [
    ("kha_moe_6b_a1b.sh", dict(VARIANT="baseline")),
    ("kha_moe_6b_a1b.sh", dict(VARIANT="kha-mlp", LAUNCH="multi", NNODES="4", NODE_RANK="1",
                               MASTER_ADDR="node0")),
    ("kha_moe_6b_a1b.sh", dict(VARIANT="mea", MEA_NC="2", LAUNCH="slurm", NNODES="16", TP="2",
                               PRECISION="fp8")),
    ("mea_llama3_1b.sh", dict(VARIANT="baseline", LR="1e-4")),
    ("mea_llama3_1b.sh", dict(VARIANT="mea", LR="3e-3", LAUNCH="slurm", NNODES="8",
                              PRECISION="fp8", TP="2")),
]


@pytest.mark.parametrize("script,env", CASES,
                         ids=[f"{s[:-3]}-{'-'.join(e.values())}" for s, e in CASES])
def test_example_validates_in_dry_run(script, env):
    result = run_example(script, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DRY RUN OK" in result.stdout
    assert "torchrun" in result.stdout
    if script.startswith("kha_moe_6b"):
        # The KHA paper's 6.1B-total / 1.01B-active, within 2%, in every flavour.
        total, active, _ = SIZE_LINE.search(result.stdout).groups()
        assert abs(float(total) / 6.1 - 1) < 0.02 and abs(float(active) / 1.01 - 1) < 0.02


def test_bad_launch_is_rejected_with_the_reason():
    result = run_example("kha_moe_6b_a1b.sh", VARIANT="mea", EP="16")  # 8 GPUs cannot hold EP 16
    assert result.returncode == 1
    assert "not divisible by ETP*EP*PP (1*16*1)" in result.stderr


BASE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
        "--group-query-attention", "--num-query-groups", "4", "--seq-length", "512",
        "--max-position-embeddings", "512", "--micro-batch-size", "1", "--train-iters", "10",
        "--mock-data", "--bf16", "--swiglu", "--normalization", "RMSNorm"]


@pytest.mark.parametrize(
    "extra,world,match",
    [
        (["--tensor-model-parallel-size", "3"], 8, r"world size \(8\) is not divisible by TP\*PP\*CP"),
        (["--global-batch-size", "6"], 4, r"global batch size \(6\) is not divisible"),
        (["--pipeline-model-parallel-size", "3"], 3, r"--num-layers \(4\) must be divisible"),
        (["--attention-variant", "mea", "--mea-num-kv-components", "3"], 1,
         r"mea_num_kv_components \(3\) must divide num_attention_heads \(8\)"),
        (["--num-experts", "8", "--expert-model-parallel-size", "3"], 3,
         r"--num-experts \(8\) must be divisible by --expert-model-parallel-size \(3\)"),
    ],
    ids=["tp-world", "batch", "pp-layers", "mea-config", "experts-ep"],
)
def test_dry_run_names_the_problem(extra, world, match):
    with pytest.raises(DryRunError, match=match):
        dry_run(BASE + extra, world)


def test_unknown_flag_fails_like_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--world-size", "1", "--"] + BASE + ["--attention-varaint", "mea"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --attention-varaint" in capsys.readouterr().err
