"""The command-line tools' consoles: the warning filters drop the notices a user cannot act on,
and only them; `mea-pretrain` keeps Megatron-Core's INFO records in its run's log file, off the
console; `mea-eval` prints no Megatron-Core notices, CPU patch list or git error."""

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_mea.apps.training.run_dir import RUN_LOG
from megatron_mea.runtime.quiet import quiet_warnings
from tests._dist import standalone_environment
from tests._models import tiny_flags

ROOT = Path(__file__).resolve().parents[1]


def test_the_tools_drop_torchs_sharded_tensor_notice_and_keep_others():
    # torch's own message: if torch rewords it, this fails and the filter needs the new words.
    from torch.distributed._shard._utils import DEPRECATE_MSG

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()
        warnings.warn(DEPRECATE_MSG, FutureWarning)
        warnings.warn("a notice the user can act on", FutureWarning)
    assert [str(w.message) for w in caught] == ["a notice the user can act on"]


# A tiny byte-level MoE run (mock data), shared by the console tests of mea-pretrain and mea-eval.
TINY_RUN = tiny_flags(mock_data=True, log_interval=1, tokenizer_type="ByteLevelTokenizer",
                      train_iters=2)
# What Megatron-Core logs at INFO on every start: config objects, the parameter names of each
# gradient bucket, the optimizer's settings (checked to be in the run's log file instead).
MEGATRON_START_RECORDS = ("DistributedDataParallelConfig(", "Params for bucket",
                          "OptimizerConfig(")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(run directory, CompletedProcess) of one `mea-pretrain` run with its console captured."""
    root = tmp_path_factory.mktemp("quiet")
    run = subprocess.run(
        [sys.executable, "-m", "megatron_mea.cli.pretrain", *TINY_RUN, "--save",
         str(root / "run"), "--data-cache-path", str(root / "cache")],
        cwd=ROOT, env=standalone_environment(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "run", run


@pytest.mark.slow
def test_mea_pretrain_console_has_progress_and_metrics_and_its_log_file_megatrons_records(
        pretrained):
    run_dir, run = pretrained
    console = run.stdout + run.stderr
    assert " iteration      1/2 | lm loss: " in console
    assert f"saved checkpoint {run_dir / 'iter_0000002'}" in console
    assert not [r for r in MEGATRON_START_RECORDS if r in console], console[-3000:]
    assert " INFO megatron.core" not in console
    run_log = (run_dir / RUN_LOG).read_text()
    assert all(record in run_log for record in MEGATRON_START_RECORDS)
    assert " iteration      2/2 | lm loss: " in run_log  # this package's records too


@pytest.mark.slow
def test_mea_eval_console_has_no_megatron_notices_patch_list_or_git_error(
        pretrained, tmp_path):
    run_dir, _ = pretrained
    # Outside any git repository (the harness asks git for the working directory's commit);
    # the task's data path is relative to the working directory.
    shutil.copytree(ROOT / "tests" / "eval_task", tmp_path / "tests" / "eval_task")
    env = standalone_environment(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                                 TRANSFORMERS_OFFLINE="1",
                                 HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    run = subprocess.run(
        [sys.executable, "-m", "megatron_mea.cli.evaluate", "--load", str(run_dir),
         "--include-path", "tests/eval_task", "--tasks", "mea_local_choice", "--limit", "2"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    console = run.stdout + run.stderr
    assert "|mea_local_choice|" in run.stdout
    for noise in ("Megatron-FSDP", "CPU patches applied", "fatal: not a git repository"):
        assert noise not in console, console[-3000:]
