"""`mea-demo` (what `make demo` runs), on a tiny setting (a 200 kB corpus, one to three steps):
run twice in one directory, both end with the table and the plot, the second keeps what the
first trained; an interrupted demo continues from its last checkpoint; a damaged final
checkpoint is trained again; the console is the bars, one line per stage and the table, and
Megatron-Core's records are in the runs' log files."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_mea.apps.sweeps.runs import read_metrics
from tests._dist import standalone_environment

# `make demo`: its reruns, its console and its log files: application code, the same on every
# Megatron-Core release; tested with one. Its interruption drill waits on wall-clock time: `make
# test` runs it in its serial pass, after the parallel one (docs/testing.md).
pytestmark = [pytest.mark.slow, pytest.mark.one_release("0.16"), pytest.mark.serial]

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--corpus-bytes", "200000"]
BAR_NAMES = ("preprocess", "baseline", "mea", "mea-vh", "kha")


def _demo_command(out, *flags):
    return [sys.executable, "-m", "megatron_mea.cli.demo", "--out", str(out), *TINY, *flags]


def _demo(out, *flags):
    run = subprocess.run(_demo_command(out, *flags), cwd=ROOT, env=standalone_environment(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def _assert_quiet_console_with_table(run, out, variants):
    """stdout: `[demo]` lines and the summary table only; stderr: progress bars only, labelled
    by variant; the table and the plot written."""
    table = (out / "summary.txt").read_text().splitlines()
    assert [row.split()[0] for row in table[1:]] == list(variants)
    lines = [line for line in run.stdout.splitlines() if line]
    assert all(line.startswith("[demo] ") or line in table for line in lines), run.stdout
    assert [line for line in lines if line in table] == table
    segments = [s for s in re.split(r"[\r\n]", run.stderr) if s.strip()]
    labels = {s.split(":", 1)[0] for s in segments}
    assert labels <= set(BAR_NAMES), run.stderr[-3000:]
    assert "INFO" not in run.stdout + run.stderr
    assert (out / "loss_curves.png").stat().st_size > 0
    assert f"[demo] loss curves: {out / 'loss_curves.png'}" in run.stdout
    assert f"[demo] logs: {out / 'demo.log'}" in run.stdout
    return labels


def test_demo_twice_in_one_directory_keeps_the_first_runs(tmp_path):
    out = tmp_path / "demo"
    # mea-vh alone: its bar is the one the attention variant's name mislabelled; one step.
    variants = ("mea-vh",)
    first = _demo(out, "--train-iters", "1", "--variants", *variants)
    # The mea-vh run's bar is labelled mea-vh, not by its attention variant (mea).
    assert _assert_quiet_console_with_table(first, out, variants) == {"preprocess", *variants}
    for name in variants:
        assert f"[demo] {name}: trained afresh to iteration 1 in " in first.stdout
        run_log = (out / "runs" / name / "mea-pretrain.log").read_text()
        assert "INFO megatron.core.datasets" in run_log and "Params for bucket" in run_log
    assert "$ " + sys.executable + " -m megatron_mea.cli.generate" in (out / "demo.log").read_text()
    checkpoint = out / "runs" / "mea-vh" / "iter_0000001"
    saved_at = {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()}
    table = (out / "summary.txt").read_text()

    second = _demo(out, "--train-iters", "1", "--variants", *variants)
    _assert_quiet_console_with_table(second, out, variants)
    assert "kept from an earlier demo" in second.stdout
    for name in variants:
        assert f"[demo] {name}: complete from an earlier demo, kept" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()} == saved_at
    assert (out / "summary.txt").read_text() == table


def _wait_for_checkpoint(path, process, timeout=300):
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert process.poll() is None, "the demo ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    return int(path.read_text())


def test_an_interrupted_demo_continues_and_a_damaged_final_checkpoint_is_trained_again(tmp_path):
    out = tmp_path / "demo"
    flags = ("--train-iters", "3", "--save-interval", "1", "--variants", "baseline")
    run_dir = out / "runs" / "baseline"
    # Killed (the demo and its mea-pretrain) at its first checkpoint, as a closed terminal would.
    process = subprocess.Popen(_demo_command(out, *flags), cwd=ROOT, env=standalone_environment(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        saved = _wait_for_checkpoint(run_dir / "latest_checkpointed_iteration.txt", process)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert saved < 3

    resumed = _demo(out, *flags)
    _assert_quiet_console_with_table(resumed, out, ["baseline"])
    assert f"[demo] baseline: continued from iteration {saved} to iteration 3 in " in resumed.stdout
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3]

    # A file of the final checkpoint cut short: the run is not kept, it starts again.
    shard = next((run_dir / "iter_0000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    again = _demo(out, *flags)
    _assert_quiet_console_with_table(again, out, ["baseline"])
    assert ("[demo] baseline: trained afresh (its checkpoint of iteration 3 is damaged) to "
            "iteration 3 in ") in again.stdout
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert sorted(p.name for p in run_dir.glob("iter_*")) == [
        "iter_0000001", "iter_0000002", "iter_0000003"]
