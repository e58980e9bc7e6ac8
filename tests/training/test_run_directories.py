"""`run_dir`: one writer per --save (a lock that dies with its process), no silent fresh start
from a --load without a checkpoint, no fresh run over another run's checkpoints, and a
metrics.jsonl of one run only. Plain file-system checks, no process group."""

import logging
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from megatron_mea.apps.training.run_dir import (
    LOCK,
    RunDirectoryError,
    SaveLock,
    check_load,
    claim_run_directories,
)
from tests._dist import standalone_environment
from tests._models import tiny_flags

# The run-directory locks: application code, the same on every Megatron-Core release; tested with
# one. Its drills wait on wall-clock time (a killed writer): `make test` runs them in its serial
# pass, after the parallel one (docs/testing.md).
pytestmark = [pytest.mark.one_release("0.16"), pytest.mark.serial]


def _args(**kwargs):
    values = dict(save=None, load=None, ckpt_step=None, exit_on_missing_checkpoint=True,
                  overwrite_save=False, rewind_save=False)
    return SimpleNamespace(**{**values, **kwargs})


def _run_dir(path, iterations=(3,), tracker=True, metrics=True):
    os.makedirs(path, exist_ok=True)
    for iteration in iterations:
        os.makedirs(os.path.join(path, f"iter_{iteration:07d}"))
    if tracker:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(iterations[-1]))
    if metrics:
        with open(os.path.join(path, "metrics.jsonl"), "w") as handle:
            handle.write('{"iteration": 1}\n')
    return str(path)


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    first = SaveLock(str(tmp_path))
    first.acquire()
    with pytest.raises(RunDirectoryError, match=rf"--save {tmp_path}: in use by another run "
                                                rf"\(pid {os.getpid()} on .*; lock .*{LOCK}\)"):
        SaveLock(str(tmp_path)).acquire()  # another open file: flock refuses it
    first.release()
    assert not os.path.exists(tmp_path / LOCK)
    second = SaveLock(str(tmp_path))
    second.acquire()
    second.release()


def test_a_stale_lock_of_a_dead_run_is_reported_and_taken_over(tmp_path, caplog):
    (tmp_path / LOCK).write_text("pid 999999 on elsewhere, started 2026-01-01 00:00:00")
    lock = SaveLock(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "stale lock of a run that is no longer running (pid 999999 on elsewhere" in caplog.text
    assert f"pid {os.getpid()}" in (tmp_path / LOCK).read_text()
    lock.release()


def test_a_load_without_a_checkpoint_is_an_error_unless_a_fresh_start_is_asked(tmp_path):
    typo = str(tmp_path / "typo")
    with pytest.raises(RunDirectoryError, match=r"--load .*typo: no such directory; pass "
                                                r"--no-exit-on-missing-checkpoint"):
        check_load(_args(load=typo))
    assert check_load(_args(load=typo, exit_on_missing_checkpoint=False)) is False
    run = _run_dir(tmp_path / "run", iterations=(3, 6), tracker=False)  # the marker deleted
    with pytest.raises(RunDirectoryError, match=r"no latest_checkpointed_iteration.txt "
                                                r"\(iter_0000006 is there: pass --ckpt-step 6"):
        check_load(_args(load=run))
    assert check_load(_args(load=run, ckpt_step=3)) is True


def test_a_fresh_run_refuses_a_save_holding_checkpoints(tmp_path):
    run = _run_dir(tmp_path / "run")
    for args in (_args(save=run),  # a forgotten --load
                 _args(save=run, load=_run_dir(tmp_path / "other"))):  # another run's weights
        with pytest.raises(RunDirectoryError, match=r"holds checkpoints of another run "
                                                    r"\(iter_0000003\).*--overwrite-save"):
            claim_run_directories(args)
        assert not os.path.exists(os.path.join(run, LOCK))  # released on refusal
    assert os.path.exists(os.path.join(run, "metrics.jsonl"))  # nothing moved or lost


def test_rewinding_into_the_same_save_moves_the_later_checkpoints_aside_only_when_asked(
    tmp_path,
):
    run = _run_dir(tmp_path / "run", iterations=(20, 40, 60))
    with pytest.raises(RunDirectoryError, match=r"--ckpt-step 20 rewinds the run there, which "
                                                r"has 2 later checkpoint\(s\) \(iter_0000040 "
                                                r"\.\. iter_0000060\); pass --rewind-save"):
        claim_run_directories(_args(save=run, load=run, ckpt_step=20))
    assert sorted(os.listdir(run)) == ["iter_0000020", "iter_0000040", "iter_0000060",
                                       "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    lock, loads = claim_run_directories(_args(save=run, load=run, ckpt_step=20,
                                              rewind_save=True))
    lock.release()
    assert loads
    assert sorted(n for n in os.listdir(run) if n.startswith("iter_")) == ["iter_0000020"]
    assert sorted(os.listdir(os.path.join(run, "rewound_from_iter_0000060"))) == [
        "iter_0000040", "iter_0000060"]
    assert open(os.path.join(run, "latest_checkpointed_iteration.txt")).read() == "20"
    # Resuming at the newest checkpoint, or into another --save, moves nothing.
    lock, _ = claim_run_directories(_args(save=run, load=run, ckpt_step=20))
    lock.release()


def test_continuing_keeps_the_metrics_and_a_new_run_moves_them_aside(tmp_path):
    run = _run_dir(tmp_path / "run")
    lock, loads = claim_run_directories(_args(save=run, load=run))
    assert loads and os.path.exists(os.path.join(run, "metrics.jsonl"))
    lock.release()
    lock, loads = claim_run_directories(_args(save=run, overwrite_save=True))
    assert not loads and not os.path.exists(os.path.join(run, "metrics.jsonl"))
    assert open(os.path.join(run, "metrics.jsonl.1")).read() == '{"iteration": 1}\n'
    lock.release()
    # A run that died before its first checkpoint left metrics only: a fresh start moves them.
    early = _run_dir(tmp_path / "early", iterations=(), tracker=False)
    lock, _ = claim_run_directories(_args(save=early))
    assert sorted(os.listdir(early)) == [LOCK, "metrics.jsonl.1"]
    lock.release()


# ---- the command line: a second writer, a SIGKILLed run, a typo in --load -------------------

TINY = tiny_flags(mock_data=True, attention_variant="mea")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _command(argv):
    return [sys.executable, "-m", "megatron_mea.cli.pretrain", *TINY, *argv]


def _refusal(argv):
    """Run mea-pretrain to its refusal: (status, its one error line, stderr)."""
    run = subprocess.run(_command(argv), cwd=_ROOT, env=standalone_environment(), capture_output=True, text=True,
                         timeout=300)
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("mea-pretrain: error:")]
    assert len(lines) == 1, run.stderr[-3000:]
    return run.returncode, lines[0], run.stderr


def test_second_writer_sigkill_and_a_typo_lose_nothing(tmp_path):
    save = str(tmp_path / "run")
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    first = subprocess.Popen(_command(["--train-iters", "100000", "--save", save,
                                       "--save-interval", "1"]),
                             cwd=_ROOT, env=standalone_environment(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not os.path.exists(tracker) and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert os.path.exists(tracker), "the first run saved no checkpoint"
        # A second writer (resuming the same directory) is refused while the first one runs.
        status, line, _ = _refusal(["--train-iters", "4", "--save", save, "--load", save])
        assert status == 2
        assert re.search(rf"--save {save}: in use by another run \(pid {first.pid} on ", line)
        # SIGKILL: the trainer's helper processes (checkpoint writers) die with it.
        helpers = psutil.Process(first.pid).children(recursive=True)
        assert helpers, "the trainer has no helper process to check"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        _, alive = psutil.wait_procs(helpers, timeout=15)
        assert not alive, f"{[p.pid for p in alive]} outlived the killed trainer"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    saved = open(tracker).read()
    # A forgotten --load: the stale lock is reported and the fresh run refused.
    status, line, stderr = _refusal(["--train-iters", "4", "--save", save])
    assert status == 2 and "stale lock of a run that is no longer running" in stderr
    assert re.search(r"holds checkpoints of another run \(iter_\d{7}\) and this run starts "
                     r"from scratch; pass --load .* --overwrite-save", line)
    # A typo in --load.
    status, line, _ = _refusal(["--train-iters", "4", "--save", save, "--load", save + "x"])
    assert status == 2 and re.search(r"--load .*runx: no such directory; pass "
                                     r"--no-exit-on-missing-checkpoint", line)
    assert open(tracker).read() == saved  # nothing was overwritten


def test_a_refused_run_leaves_no_save_directory_behind(tmp_path):
    save = str(tmp_path / "new-run")
    with pytest.raises(RunDirectoryError, match="no such directory"):
        claim_run_directories(_args(save=save, load=str(tmp_path / "no-such-run")))
    assert not os.path.exists(save)
    # A --save that existed stays, and one the run wrote to is kept.
    os.makedirs(save)
    with pytest.raises(RunDirectoryError):
        claim_run_directories(_args(save=save, load=str(tmp_path / "no-such-run")))
    assert os.listdir(save) == []
    written = SaveLock(str(tmp_path / "written"))
    written.acquire()
    (tmp_path / "written" / "metrics.jsonl").write_text("{}\n")
    written.release()
    assert os.listdir(tmp_path / "written") == ["metrics.jsonl"]


def test_a_save_the_system_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    # 4,067 characters: the directory itself could be made, the checkpoint files under it not.
    long_path = str(tmp_path)
    while len(long_path) < 4067 - 201:
        long_path = os.path.join(long_path, "d" * 200)
    long_path = os.path.join(long_path, "s" * (4066 - len(long_path)))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    path_max, name_max = (os.pathconf(tmp_path, name) for name in ("PC_PATH_MAX", "PC_NAME_MAX"))
    assert path_max <= 4067 + 80 and name_max < 300  # Linux's 4096 and 255
    for save, match in [
        (long_path, r"the path is 4067 bytes, and the checkpoint files under it need up to 80 "
                    rf"more, over this system's limit of {path_max - 1}; choose a shorter --save"),
        (str(tmp_path / ("n" * 300)), r"the name n{60}\.\.\.n{30} is 300 bytes, over this file "
                                      rf"system's limit of {name_max}"),
        (str(a_file / "save"), rf"--save {a_file}/save: cannot write there \(Not a directory"),
    ]:
        with pytest.raises(RunDirectoryError, match=match):
            claim_run_directories(_args(save=save))
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_a_read_only_save_is_refused_before_anything_is_written(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through a read-only mode (the not-a-directory case above and "
                    "the RLIMIT_FSIZE tests in test_reliability.py cover the refusal)")
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(RunDirectoryError, match=r"cannot write there \(Permission denied"):
            claim_run_directories(_args(save=str(tmp_path / "save")))
    finally:
        tmp_path.chmod(0o755)


def test_no_space_for_the_lock_files_line_is_refused_and_holds_nothing(tmp_path):
    import resource

    # A file-size limit of 0 (the kernel fails the write with EFBIG, as a full disk with
    # ENOSPC; Python ignores SIGXFSZ), in this process only while claiming.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        with pytest.raises(RunDirectoryError, match=r"--save .*: cannot write there \(File too "
                                                    r"large\)"):
            claim_run_directories(_args(save=str(tmp_path / "save")))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    lock = SaveLock(str(tmp_path / "save"))  # the failed claim holds no lock
    lock.acquire()
    lock.release()
