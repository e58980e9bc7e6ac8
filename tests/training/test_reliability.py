"""Crash-safe checkpoints, refusal of bad checkpoints (one line from the CLI), and the NaN policy
(real processes)."""

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megatron_mea import compat
from tests._dist import free_port, run_distributed, standalone_environment
from tests._models import tiny_flags

# Drills that wait on wall-clock time (signals, timeouts, killed processes): `make test` runs
# them in its serial pass, after the parallel one (docs/testing.md).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Variables of a launcher around this test session that a CLI run must not inherit.

TINY = tiny_flags(mock_data=True, attention_variant="mea")


def _train(rank, world_size, argv, sabotage=None):
    """Run mea-pretrain; `sabotage` names a fault to inject into this process."""
    from megatron_mea.apps.training import loop
    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.checkpoint.torch_dist import training_state

    if sabotage is not None:
        _install(sabotage, training_state, loop)
    return [record["lm loss"] for record in loop.pretrain(*parse_run(argv))]


def _install(sabotage, training_state, loop):
    kind, when = sabotage

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    # The loss of every micro-batch of iteration `when` (nan), or of every one from `when` on
    # (nan-from), becomes NaN.
    if kind in ("nan", "nan-from"):
        original, calls = loop._masked_mean_loss, [0]

        def nan_loss(mask, output):
            calls[0] += 1
            loss, report = original(mask, output)
            iteration = (calls[0] - 1) // 2 + 1  # two micro-batches per iteration
            if iteration == when or (kind == "nan-from" and iteration > when):
                loss = loss * float("nan")
                report = {"lm loss": loss.detach().clone()}
            return loss, report

        loop._masked_mean_loss = nan_loss
        return
    save, rename, replace = (
        training_state.dist_checkpointing.save, training_state.os.rename, training_state.os.replace
    )
    target = f"iter_{when:07d}"

    def save_then_die(state, directory, **kwargs):  # shards half written
        save(state, directory, **kwargs)
        if target in directory:
            shard = sorted(f for f in os.listdir(directory) if f.endswith(".distcp"))[0]
            with open(os.path.join(directory, shard), "r+b") as handle:
                handle.truncate(os.path.getsize(handle.name) // 2)
            kill()

    # These patch the os module for everyone (torch renames its own files with Paths too), so
    # they act only on the plugin's own renames.
    def rename_or_die(src, dst):
        if str(src).endswith(target + ".tmp"):
            kill()
        rename(src, dst)

    def replace_or_die(src, dst):
        pointer = str(dst).endswith("latest_checkpointed_iteration.txt")
        if pointer and open(src).read() == str(when):
            kill()
        replace(src, dst)

    if kind == "during-shard-write":
        training_state.dist_checkpointing.save = save_then_die
    elif kind == "before-rename":
        training_state.os.rename = rename_or_die
    elif kind == "before-pointer-update":
        training_state.os.replace = replace_or_die


@pytest.fixture(scope="module")
def uninterrupted():
    return run_distributed(_train, 1, [*TINY, "--train-iters", "8"])[0]


@pytest.mark.parametrize("point", ["during-shard-write", "before-rename", "before-pointer-update"])
def test_sigkill_during_save_keeps_the_last_checkpoint_and_resume_is_exact(
    tmp_path, uninterrupted, point
):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "8", "--save", ckpt, "--save-interval", "3"]
    with pytest.raises(RuntimeError, match="distributed run failed"):
        run_distributed(_train, 1, argv, (point, 6))  # killed while saving iteration 6
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as handle:
        assert handle.read() == "3"
    resumed = run_distributed(_train, 1, [*argv, "--load", ckpt])[0]
    assert resumed == uninterrupted[3:]


def test_nan_step_is_skipped_and_training_continues(uninterrupted):
    losses = run_distributed(_train, 1, [*TINY, "--train-iters", "8"], ("nan", 3))[0]
    assert losses[:2] == uninterrupted[:2]
    assert losses[2] != losses[2]  # NaN reported for the skipped step
    assert all(loss == loss for loss in losses[3:])  # no NaN leaked into the weights


def test_nan_stop_policy_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "8", "--save", ckpt, "--save-interval", "2",
            "--nan-policy", "stop"]
    with pytest.raises(RuntimeError, match=r"iteration 5: non-finite lm loss .* nan_policy=stop; "
                                           r"the last good checkpoint is .*/iter_0000004: resume "
                                           r"from it with --load .* --ckpt-step 4"):
        run_distributed(_train, 1, argv, ("nan", 5))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as handle:
        assert handle.read() == "4"
    assert run_distributed(_train, 1, [*argv, "--load", ckpt, "--nan-policy", "skip"])[0]


def test_no_checkpoint_is_saved_inside_a_nan_streak_and_the_stop_names_the_last_good_one(
    tmp_path,
):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "12", "--save", ckpt, "--save-interval", "2",
            "--nan-max-consecutive-skips", "4"]
    # Iterations 5-8 are NaN: the saves due at 6 and 8 are left out, the streak stops at 8.
    with pytest.raises(RuntimeError, match=(
        r"iteration 8: 4 non-finite steps in a row \(from iteration 5; "
        r"nan_max_consecutive_skips=4\); stopped, no checkpoint saved inside the streak; the "
        rf"last good checkpoint is {re.escape(ckpt)}/iter_0000004: resume from it with --load "
        rf"{re.escape(ckpt)} --ckpt-step 4"
    )):
        run_distributed(_train, 1, argv, ("nan-from", 5))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as handle:
        assert handle.read() == "4"
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [
        "iter_0000002", "iter_0000004"]


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("good") / "ckpt")
    run_distributed(_train, 1, [*TINY, "--train-iters", "2", "--save", ckpt, "--save-interval",
                                "1"])
    return ckpt


def _remove_common_state(iteration):
    """Delete the checkpoint's common state in whichever layout it was written: the `common.pt`
    file (Megatron-Core 0.16) or the `common_state` entry of the torch_dist index (0.17+)."""
    common = os.path.join(iteration, "common.pt")
    if os.path.exists(common):
        os.remove(common)
        return
    index_path = os.path.join(iteration, ".metadata")
    index = FileSystemReader(iteration).read_metadata()
    keys = [key for key in index.state_dict_metadata if key.startswith("common_state")]
    assert keys, "the checkpoint has neither common.pt nor a common_state entry"
    for key in keys:
        del index.state_dict_metadata[key]
    with open(index_path, "wb") as handle:
        pickle.dump(index, handle)  # the index format torch.distributed.checkpoint writes


def _corrupt(saved, tmp_path, how):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    iteration = os.path.join(ckpt, "iter_0000002")
    # The checks that do not need the checksum list: as for a checkpoint saved without one.
    os.remove(os.path.join(iteration, "checksums.json"))
    shards = sorted(f for f in os.listdir(iteration) if f.endswith(".distcp"))
    shard = os.path.join(iteration, shards[0])
    if how == "missing shard":
        os.remove(shard)
    elif how == "truncated shard":
        with open(shard, "r+b") as handle:
            handle.truncate(100)
    elif how == "missing common state":
        _remove_common_state(iteration)
    elif how == "bad pointer":
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write("two")
    elif how == "binary pointer":
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "wb") as handle:
            handle.write(b"\xff\xfe\x00\x01")
    elif how == "corrupt metadata.json":
        with open(os.path.join(iteration, "metadata.json"), "w") as handle:
            handle.write('{"sharded_backend": ')
    elif how == "corrupt common.pt":
        if not os.path.exists(os.path.join(iteration, "common.pt")):
            pytest.skip("this Megatron-Core writes no common.pt")
        with open(os.path.join(iteration, "common.pt"), "r+b") as handle:
            handle.truncate(50)
    return ckpt, shard


@pytest.mark.parametrize(
    "how,match",
    [
        ("missing shard", r"__0_0.distcp: shard file is missing"),
        ("truncated shard", r"__0_0.distcp: truncated \(100 bytes"),
        ("missing common state", r"common.pt: missing, and no 'common_state' object in the index"),
        ("bad pointer", r"latest_checkpointed_iteration.txt: expected an iteration number"),
        ("binary pointer", r"latest_checkpointed_iteration.txt: expected an iteration number, "
                           r"found b'\\xff\\xfe"),
        ("corrupt metadata.json", r"metadata.json: not valid JSON"),
        ("corrupt common.pt", r"common.pt: not a torch.save archive .* the older checkpoint "
                              r"iter_0000001 is complete: pass --ckpt-step 1"),
    ],
)
def test_corrupt_checkpoint_is_refused_naming_the_file(saved_checkpoint, tmp_path, how, match):
    ckpt, _ = _corrupt(saved_checkpoint, tmp_path, how)
    with pytest.raises(RuntimeError, match=match):
        run_distributed(_train, 1, [*TINY, "--train-iters", "4", "--load", ckpt])


def test_checkpoint_of_another_model_is_refused_naming_the_setting_and_both_values(
    saved_checkpoint,
):
    # The saving run's config.yaml (next to the checkpoints) names the setting that differs.
    for flags, match in [
        (["--num-attention-heads", "8"],
         r"num_attention_heads 4 in the checkpoint, 8 in this run \(--num-attention-heads\)"),
        (["--num-layers", "3"], r"num_layers 2 in the checkpoint, 3 in this run"),
        (["--attention-variant", "kha"],
         r"attention_variant 'mea' in the checkpoint, 'kha' in this run"),
    ]:
        argv = [*TINY, "--train-iters", "4", "--load", saved_checkpoint, *flags]
        with pytest.raises(RuntimeError, match=match):
            run_distributed(_train, 1, argv)


def test_without_config_yaml_the_refusal_names_tensor_and_shapes(saved_checkpoint, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved_checkpoint, ckpt)
    os.remove(os.path.join(ckpt, "config.yaml"))
    argv = [*TINY, "--train-iters", "4", "--load", ckpt, "--hidden-size", "96"]
    with pytest.raises(RuntimeError, match=r"tensor '.*' has shape \[.*64.*\] in the checkpoint, "
                                           r"this model expects \[.*96.*\]"):
        run_distributed(_train, 1, argv)


def _cli(argv, **env):
    """`python -m megatron_mea.cli.pretrain argv` as a world of its own: (exit status, stderr)."""
    run = subprocess.run([sys.executable, "-m", "megatron_mea.cli.pretrain", *argv],
                         cwd=ROOT, env=standalone_environment(**env), capture_output=True, text=True,
                         timeout=300)
    return run.returncode, run.stderr


def _one_line_error(stderr):
    """The `mea-pretrain:` line of stderr, asserting there is one and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("mea-pretrain:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_cli_refuses_another_models_checkpoint_in_one_line(saved_checkpoint):
    status, stderr = _cli([*TINY, "--train-iters", "4", "--load", saved_checkpoint,
                           "--num-query-groups", "4"])
    assert status == 2  # a refused input
    line = _one_line_error(stderr)
    assert re.search(r"num_query_groups 2 in the checkpoint, 4 in this run", line), line


def test_cli_refuses_a_layout_the_heads_do_not_divide_in_one_line(saved_checkpoint):
    # The model's shape comes from the flags, which must match the checkpoint's: at TP=4 its
    # 2 query groups cannot be split (refused before any process starts).
    # (--sequence-parallel: MoE at TP > 1 without it is refused before the heads are looked at.)
    status, stderr = _cli([*TINY, "--train-iters", "4", "--load", saved_checkpoint,
                           "--tensor-model-parallel-size", "4", "--sequence-parallel"],
                          WORLD_SIZE="4")
    assert status == 2
    line = _one_line_error(stderr)
    assert re.search(r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size "
                     r"\(4\)", line), line


def _as_newer_layout(saved, tmp_path):
    """A copy of `saved` whose common state is in the index, as Megatron-Core 0.17+ writes it:
    `common.pt` gone, a `common_state` object in the torch_dist index (already so when this
    Megatron-Core wrote it)."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    iteration = os.path.join(ckpt, "iter_0000002")
    os.remove(os.path.join(iteration, "checksums.json"))  # as Megatron-LM writes it
    common = os.path.join(iteration, "common.pt")
    if os.path.exists(common):
        os.remove(common)
        index = FileSystemReader(iteration).read_metadata()
        index.state_dict_metadata["common_state/shard_0_1"] = BytesStorageMetadata()
        with open(os.path.join(iteration, ".metadata"), "wb") as handle:
            pickle.dump(index, handle)  # the index format torch.distributed.checkpoint writes
    return ckpt, iteration


NEWER_LAYOUT = (r"written by megatron-core 0.17 or later \(its common state is stored in the "
                r"index, not in common.pt\), which megatron-core .* cannot read: load it with "
                r"megatron-core 0.17 or later")


def test_newer_megatron_checkpoint_is_refused_where_unreadable(
    saved_checkpoint, tmp_path, monkeypatch
):
    from megatron_mea import compat
    from megatron_mea.checkpoint.torch_dist.checks import CheckpointError, verify_checkpoint

    _, iteration = _as_newer_layout(saved_checkpoint, tmp_path)
    monkeypatch.setattr(compat, "reads_common_state_from_index", lambda: False)
    with pytest.raises(CheckpointError, match=NEWER_LAYOUT):
        verify_checkpoint(iteration, model=None)  # refused before the model is looked at


@pytest.mark.skipif(compat.reads_common_state_from_index(),
                    reason="this Megatron-Core reads the newer layout")
def test_cli_refuses_a_newer_megatron_checkpoint_in_one_line(saved_checkpoint, tmp_path):
    ckpt, _ = _as_newer_layout(saved_checkpoint, tmp_path)
    status, stderr = _cli([*TINY, "--train-iters", "4", "--load", ckpt])
    assert status == 2
    assert re.search(NEWER_LAYOUT, _one_line_error(stderr))


# ---- checksums, crafted pickles, data settings ------------------------------------------------


def _flip_a_bit(path, offset=5000):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x40]))  # an exponent bit of a float32, as in the report


def test_a_flipped_bit_is_refused_naming_the_file_and_the_older_checkpoint(
    saved_checkpoint, tmp_path
):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved_checkpoint, ckpt)
    _flip_a_bit(os.path.join(ckpt, "iter_0000002", "__0_0.distcp"))
    status, stderr = _cli([*TINY, "--train-iters", "2", "--load", ckpt])
    assert status == 2
    assert re.search(r"iter_0000002/__0_0.distcp: checksum mismatch .* the older checkpoint "
                     r"iter_0000001 is complete: pass --ckpt-step 1 to load it instead",
                     _one_line_error(stderr))
    # The fallback is explicit: the older checkpoint loads when asked for.
    assert run_distributed(_train, 1, [*TINY, "--train-iters", "2", "--load", ckpt,
                                       "--ckpt-step", "1"])[0]


class _Payload:
    """Runs a shell command when unpickled (the attack)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("target", [".metadata", "common.pt"])
def test_a_crafted_pickle_is_refused_without_running_it(saved_checkpoint, tmp_path, target):
    import torch

    from megatron_mea.checkpoint.torch_dist import integrity
    from megatron_mea.checkpoint.torch_dist.checks import CheckpointError, verify_checkpoint

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved_checkpoint, ckpt)
    iteration = os.path.join(ckpt, "iter_0000002")
    path, marker = os.path.join(iteration, target), tmp_path / "ran"
    if target == ".metadata":
        index = FileSystemReader(iteration).read_metadata()
        index.planner_data = _Payload(marker)
        with open(path, "wb") as handle:
            pickle.dump(index, handle)
    elif os.path.exists(path):  # Megatron-Core 0.16 (0.17+ keeps the common state in the index)
        torch.save({"iteration": 2, "rng": _Payload(marker)}, path)
    else:
        pytest.skip("this Megatron-Core writes no common.pt")
    # A forger rewrites the checksum list too: the unpickler is the guard.
    files = integrity.checkpoint_files(iteration)
    integrity.write_checksums(iteration, integrity.checksum_files(iteration, files))
    with pytest.raises(CheckpointError, match=rf"{target}: refused: it names (os|posix)\.system"):
        verify_checkpoint(iteration, model=None)
    status = subprocess.run(
        [sys.executable, "-m", "megatron_mea.cli.generate", "--load", ckpt, "--prompt", "x"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=standalone_environment(),
    )
    assert status.returncode != 0 and "Traceback" not in status.stderr, status.stderr[-3000:]
    assert re.search(r"refused: it names (os|posix)\.system", status.stderr)
    assert not marker.exists()


@pytest.mark.parametrize("flags,match", [
    (["--seq-length", "64"], r"seq_length 32 in the checkpoint, 64 in this run \(--seq-length\)"),
    (["--vocab-size", "1000"],
     r"vocab_size 257 in the checkpoint, 1000 in this run \(--vocab-size\)"),
])
def test_resuming_with_other_data_settings_is_refused(saved_checkpoint, flags, match):
    argv = [*TINY, "--train-iters", "2", "--load", saved_checkpoint, *flags]
    with pytest.raises(RuntimeError, match=match + r".*--override-checkpoint-data-settings"):
        run_distributed(_train, 1, argv)


# ---- preemption: --exit-signal-handler -------------------------------------------------------

# Variables of an enclosing launcher that would change what torchrun sets up.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


def _metrics(save):
    path = os.path.join(save, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]


def _children(pid):
    """The processes whose parent is `pid` (Linux)."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or one that has just ended
        if fields[1] == str(pid):
            children.append(int(entry))
    return children


def _signal_after(process, save, steps, signum, timeout=120, to="process"):
    """Send `signum` once `steps` steps are in `save`'s metrics.jsonl; returns (exit status,
    output). `to`: "process", its "group" (as a scheduler, `timeout` or `kill -TERM -PGID`
    does), or "process and children" (SLURM: a launcher and its workers at once)."""
    deadline = time.monotonic() + timeout
    while len(_metrics(save)) < steps:
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    if to == "group":
        os.killpg(process.pid, signum)
    else:
        for pid in [process.pid, *(_children(process.pid) if to != "process" else [])]:
            os.kill(pid, signum)
    return process.wait(timeout=timeout), process.communicate()[0]


def _interrupted_lines(output, name, save):
    """The `mea-pretrain: interrupted` lines (one per rank, all the same) after at most one
    acknowledgement of the signal; returns the saved iteration."""
    lines = [line for line in output.splitlines() if line.startswith("mea-pretrain:")]
    acknowledged = [line for line in lines if line.startswith(f"mea-pretrain: {name}: saving")]
    assert len(acknowledged) <= 1, output[-3000:]
    lines = [line for line in lines if line not in acknowledged]
    assert lines and len(set(lines)) == 1, output[-3000:]
    found = re.fullmatch(rf"mea-pretrain: interrupted by {name} after iteration (\d+): saved "
                         rf"checkpoint {re.escape(save)}/iter_(\d{{7}}); resume with --load "
                         rf"{re.escape(save)}", lines[0])
    assert found and int(found[1]) == int(found[2]), lines[0]
    return int(found[1])


def _assert_nothing_lost(save, saved):
    """The saved iteration is the last step the run reported (only the step in flight ran on)."""
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as handle:
        assert int(handle.read()) == saved
    assert [r["iteration"] for r in _metrics(save)] == list(range(1, saved + 1))


def test_sigterm_to_the_process_group_after_a_checkpoint_saves_and_resume_continues(tmp_path):
    # In a session of its own, signalled as a group after its first checkpoint: the checkpoint
    # writer's helper processes get the signal too, and must outlive it for the save.
    save = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "50", "--save", save, "--save-interval", "2"]
    process = subprocess.Popen([sys.executable, "-m", "megatron_mea.cli.pretrain", *argv],
                               cwd=ROOT, env=standalone_environment(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    status, output = _signal_after(process, save, 3, signal.SIGTERM, to="group")
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    saved = _interrupted_lines(output, "SIGTERM", save)
    assert saved >= 3
    _assert_nothing_lost(save, saved)
    # The lock is released: a resumed run takes the directory and goes on from the next step.
    run_distributed(_train, 1, [*argv, "--load", save, "--exit-interval", "1"])
    assert [r["iteration"] for r in _metrics(save)][-1] == saved + 1


def _signal_rank(rank, world_size, argv, signalled_rank, when):
    """Train; rank `signalled_rank` sends itself SIGTERM during iteration `when`."""
    from megatron_mea.apps.training import errors, loop
    from megatron_mea.apps.training.arguments import parse_run

    if rank == signalled_rank:
        original, calls = loop._masked_mean_loss, [0]

        def loss_then_signal(mask, output):
            calls[0] += 1
            if calls[0] == 2 * when:  # two micro-batches per iteration
                os.kill(os.getpid(), signal.SIGTERM)
            return original(mask, output)

        loop._masked_mean_loss = loss_then_signal
    try:
        loop.pretrain(*parse_run(argv))
    except errors.TrainingInterrupted as exc:
        return exc.signum, str(exc)
    return None


def test_a_signal_to_one_rank_stops_every_rank_after_a_common_save(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "8", "--save", save, "--tensor-model-parallel-size", "2",
            "--sequence-parallel"]
    results = run_distributed(_signal_rank, 2, argv, 1, 2)
    assert results[0] == results[1] == (
        signal.SIGTERM, f"interrupted by SIGTERM after iteration 2: saved checkpoint "
                        f"{save}/iter_0000002; resume with --load {save}")
    _assert_nothing_lost(save, 2)


def test_sigterm_to_torchrun_and_its_workers_at_tp2_saves_the_step_in_flight(tmp_path):
    # SLURM signals every process of the step: each worker gets SIGTERM directly and again
    # from torchrun, milliseconds apart, after a first checkpoint exists.
    save = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "50", "--save", save, "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--save-interval", "2"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "megatron_mea.cli.pretrain", *argv],
        env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        _, output = _signal_after(process, save, 3, signal.SIGTERM, to="process and children")
    finally:
        if process.poll() is None:
            process.kill()
    # Each worker saves its shards and says so (torchrun itself then exits 1 with its own
    # report of the signal); the repeat does not cancel the save.
    assert output.count("mea-pretrain: interrupted") == 2, output[-3000:]
    assert "second signal" not in output, output[-3000:]
    saved = _interrupted_lines(output, "SIGTERM", save)
    assert saved >= 3
    _assert_nothing_lost(save, saved)
    iteration = os.path.join(save, f"iter_{saved:07d}")
    shards = [n for n in os.listdir(iteration) if n.endswith(".distcp")]
    assert {name.split("_")[2] for name in shards} == {"0", "1"}, shards


# A first SIGTERM, the same again at once (held: a duplicate), then `sys.argv[1]`: SIGINT
# (Ctrl-C again), or SIGTERM once the repeat window has passed.
SECOND_SIGNAL = """
import os, signal, sys, time
from megatron_mea.apps.training import signals
signals.REPEAT_WINDOW_S = 1.0
with signals.ExitSignalHandler() as handler:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    assert handler.received == signal.SIGTERM
    print("first signal held", flush=True)
    if sys.argv[1] == "SIGTERM":
        time.sleep(1.0)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(5)
print("still running")
"""


# The signal handler's own rules (a duplicate held, a second Ctrl-C; a signal during set-up)
# run on one release; the signals as clusters deliver them during training run on both.
@pytest.mark.one_release("0.16")
@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM"])
def test_a_duplicate_sigterm_is_held_and_a_real_second_signal_exits_at_once(second):
    run = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, second], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env=standalone_environment())
    assert run.returncode == -getattr(signal, second), run.stderr[-3000:]
    assert run.stdout == "first signal held\n"
    assert run.stderr.splitlines() == [
        "mea-pretrain: SIGTERM: stopping at the end of the set-up stage in flight (nothing "
        "trained yet); Ctrl-C, or SIGTERM again after 1 s, exits without one",
        f"mea-pretrain: second signal ({second}): exiting without a checkpoint",
    ], run.stderr[-3000:]


# A signal to the run's process group while the dataset indices build (set-up).
SIGNAL_DURING_SET_UP = """
import os, signal, sys
if __name__ == "__main__":
    from megatron_mea import data
    from megatron_mea.cli.pretrain import main
    build = data.build_gpt_datasets_rank_zero_first
    def signal_then_build(*args, **kwargs):
        os.killpg(os.getpgid(0), getattr(signal, sys.argv[1]))
        return build(*args, **kwargs)
    data.build_gpt_datasets_rank_zero_first = signal_then_build
    sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.one_release("0.16")
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_during_set_up_ends_in_one_line_releasing_the_lock(tmp_path, name):
    save = str(tmp_path / "ckpt")
    run = subprocess.run(
        [sys.executable, "-c", SIGNAL_DURING_SET_UP, name, *TINY, "--train-iters", "3",
         "--save", save],
        cwd=ROOT, env=standalone_environment(), capture_output=True, text=True, timeout=300,
        start_new_session=True)
    assert run.returncode == 128 + getattr(signal, name), run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("mea-pretrain:")]
    again = ("press Ctrl-C again to exit without one" if name == "SIGINT"
             else "Ctrl-C, or SIGTERM again after 10 s, exits without one")
    assert lines == [
        f"mea-pretrain: {name}: stopping at the end of the set-up stage in flight (nothing "
        f"trained yet); {again}",
        f"mea-pretrain: interrupted by {name} during set-up (building the datasets' indices): "
        "nothing trained yet, so nothing saved; no checkpoint of this run yet",
    ], run.stderr[-3000:]
    assert "mea-pretrain.lock" not in os.listdir(save)
    assert not [name for name in os.listdir(save) if name.startswith("iter_")]


# ---- a wedged rank: --distributed-timeout-minutes ---------------------------------------------


def _two_ranks(command, argv):
    """Ranks 0 and 1 of a world of two on a free port, each `python *command *argv`, their
    console piped."""
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, *command, *argv], cwd=ROOT,
            env=standalone_environment(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                       OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]


def test_a_stopped_rank_ends_the_run_within_the_timeout_naming_it(tmp_path):
    save, timeout_minutes = str(tmp_path / "ckpt"), 0.15
    argv = [*TINY, "--train-iters", "50", "--save", save, "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--distributed-timeout-minutes", str(timeout_minutes)]
    ranks = _two_ranks(["-m", "megatron_mea.cli.pretrain"], argv)
    try:
        deadline = time.monotonic() + 120
        while len(_metrics(save)) < 2:
            assert ranks[0].poll() is None, ranks[0].communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.05)
        ranks[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        status = ranks[0].wait(timeout=120)
        waited = time.monotonic() - stopped_at
        output = ranks[0].communicate()[0]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert status == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = [line for line in output.splitlines() if line.startswith("mea-pretrain:")]
    assert len(line) == 1, output[-3000:]
    assert re.fullmatch(r"mea-pretrain: error: rank 0, iteration \d+: a collective waited 0.15 "
                        r"min \(--distributed-timeout-minutes\) for rank 1, which stopped "
                        r"answering \(no heartbeat\); no checkpoint of this run yet", line[0])
    # The timeout, the heartbeat check (2.5 beats of 0.9 s) and the exit, with a margin.
    assert waited < timeout_minutes * 60 + 8, waited


# Rank 1 stops (SIGSTOP, as a node swapping itself to death does) while the dataset indices
# build, during set-up.
STOP_DURING_SET_UP = """
import os, signal, sys
if __name__ == "__main__":
    from megatron_mea import data
    from megatron_mea.cli.pretrain import main
    build = data.build_gpt_datasets_rank_zero_first
    def stop_then_build(*args, **kwargs):
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        return build(*args, **kwargs)
    data.build_gpt_datasets_rank_zero_first = stop_then_build
    sys.exit(main(sys.argv[1:]))
"""


# One release: the other runs the timeout in a step (the dataset builder re-raises this one).
@pytest.mark.one_release("0.19")
def test_a_rank_that_stops_during_set_up_is_named_in_one_line(tmp_path):
    # Megatron's dataset builder re-raises gloo's timed-out barrier as a plain Exception.
    save = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "2", "--save", save, "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--distributed-timeout-minutes", "0.15"]
    ranks = _two_ranks(["-c", STOP_DURING_SET_UP], argv)
    try:
        status = ranks[0].wait(timeout=300)
        output = ranks[0].communicate()[0]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert status == 1, output[-3000:]
    assert re.fullmatch(r"mea-pretrain: error: rank 0, set-up \(building the datasets' indices\): "
                        r"a collective waited 0.15 min \(--distributed-timeout-minutes\) for rank "
                        r"1, which stopped answering \(no heartbeat\); no checkpoint of this run "
                        r"yet", _one_line_error(output))
    assert "mea-pretrain.lock" not in os.listdir(save)


# ---- data: regenerated at the same path, changed under a running job ---------------------------


def _write_data(prefix, documents):
    """Byte-level `.bin/.idx` of `documents` at `prefix` (replacing what is there)."""
    from megatron_mea.data import build_tokenizer, preprocess_files

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with open(prefix + ".jsonl", "w") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    preprocess_files([prefix + ".jsonl"], prefix, build_tokenizer("ByteLevelTokenizer"),
                     append_eod=True, progress=False)


def _data_argv(prefix, cache):
    return tiny_flags(attention_variant="mea", data_path=prefix, split="1,0,0", eval_iters=0,
                      data_cache_path=cache)


# One release: the cache key itself is tested on both, in tests/data.
@pytest.mark.one_release("0.16")
def test_data_regenerated_at_the_same_path_trains_on_the_new_data(tmp_path):
    prefix, cache = str(tmp_path / "data" / "corpus"), str(tmp_path / "cache")
    argv = [*_data_argv(prefix, cache), "--train-iters", "1"]
    _write_data(prefix, [f"old document {i} " * (4 + i % 9) for i in range(200)])
    run_distributed(_train, 1, argv)
    # Fewer, shorter documents: the old cached indices point past the new data's end.
    _write_data(prefix, [f"NEW {i} " * (2 + i % 3) for i in range(12)])
    losses = run_distributed(_train, 1, argv)[0]
    assert len(losses) == 1 and math.isfinite(losses[0])
    # Megatron's index files of each version of the data, side by side.
    documents = [n for n in os.listdir(cache) if n.endswith("-document_index.npy")]
    assert len(documents) == 2, sorted(os.listdir(cache))


# ---- run-time failures: a full disk during a save or a metrics.jsonl write -------------------

# mea-pretrain whose files may grow to LIMIT bytes once its first checkpoint is saved
# (RLIMIT_FSIZE: the kernel fails a write past it with EFBIG, as a full disk fails one with
# ENOSPC; Python ignores SIGXFSZ).
FILE_SIZE_LIMIT = """
import os, resource, sys
if __name__ == "__main__":
    from megatron_mea.apps.training import loop
    from megatron_mea.cli.pretrain import main
    save, limit = loop.Trainer.save, sys.argv[1]
    def save_then_limit(self, root):
        save(self, root)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
    loop.Trainer.save = save_then_limit
    sys.exit(main(sys.argv[2:]))
"""


def _run_with_file_size_limit(limit, argv):
    run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, limit, *argv], cwd=ROOT,
                         env=standalone_environment(), capture_output=True, text=True,
                         timeout=300)
    return run.returncode, run.stderr


def test_a_save_that_fails_for_space_ends_in_one_line_and_leaves_no_tmp(tmp_path):
    save = str(tmp_path / "ckpt")
    status, stderr = _run_with_file_size_limit(
        "20000", [*TINY, "--train-iters", "4", "--save", save, "--save-interval", "2"])
    assert status == 1, stderr[-3000:]
    # The writer's cause: EFBIG (a shard), or torch's archive writer's short write ("unexpected
    # pos": common.pt, written first, reaches the limit), named as the file-size limit.
    assert re.fullmatch(
        rf"mea-pretrain: error: iteration 4: saving checkpoint {re.escape(save)}/iter_0000004 "
        r"failed: (?:rank 0: )?(?:a file reached this process's file-size limit of 20000 "
        r"bytes \(ulimit -f\) \(the writer's words: .+\)|File too large: .+); its partial "
        r"iter_0000004.tmp was removed; the last "
        rf"checkpoint is {re.escape(save)}/iter_0000002", _one_line_error(stderr))
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"


# mea-pretrain on a small tmpfs that another writer fills after the first checkpoint, leaving
# `sys.argv[1]` bytes (0: a full disk at the next save; a page: the disk fills inside torch's
# writer, which says "iostream error").
FULL_DISK = """
import os, sys
if __name__ == "__main__":
    from megatron_mea.apps.training import loop
    from megatron_mea.cli.pretrain import main
    save, leave = loop.Trainer.save, int(sys.argv[1])
    def save_then_fill(self, root):
        save(self, root)
        with open(os.path.join(os.path.dirname(root), "filler"), "ab") as handle:
            try:
                while True:
                    handle.write(bytes(1 << 16))
                    handle.flush()
            except OSError:
                pass
            handle.truncate(max(handle.tell() - leave, 0))
    loop.Trainer.save = save_then_fill
    status = main(sys.argv[2:])
    save = sys.argv[sys.argv.index("--save") + 1]
    print(*sorted(os.listdir(save)))  # what the run left (the tmpfs goes with the namespace)
    sys.exit(status)
"""


def _on_a_small_tmpfs(disk, command):
    """`command` in a mount namespace of its own where `disk` is an 8 MiB tmpfs (a user
    namespace maps this user to root there, so no privilege is needed): (status, stdout,
    stderr)."""
    os.makedirs(disk)
    script = f'mount -t tmpfs -o size=8m tmpfs "$1" && shift && exec "$@"'
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
                          "sh", disk, *command], cwd=ROOT, env=standalone_environment(),
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.fail(f"cannot mount a tmpfs in a user namespace here: {run.stderr[-500:]}")
    return run.returncode, run.stdout, run.stderr


@pytest.mark.parametrize("leave,cause", [
    (0, r"no space left on the device holding {save} \(0 bytes free\)"),
    # A disk that fills inside torch's writer: one release is enough (`full` runs on both).
    pytest.param(4096, r"(?:rank 0: )?(?:no space left on the device holding {save} \(0 bytes "
                 r"free\) \(the writer's words: .+\)|No space left on device: .+)",
                 marks=pytest.mark.one_release("0.19")),
], ids=["full", "fills-while-writing"])
def test_a_full_disk_at_save_time_ends_in_one_line_and_leaves_no_tmp(tmp_path, leave, cause):
    disk = str(tmp_path / "disk")
    save = os.path.join(disk, "ckpt")
    status, stdout, stderr = _on_a_small_tmpfs(disk, [
        sys.executable, "-c", FULL_DISK, str(leave), *TINY, "--train-iters", "4", "--save",
        save, "--save-interval", "2"])
    assert status == 1, stderr[-3000:]
    line = _one_line_error(stderr)
    assert re.fullmatch(
        rf"mea-pretrain: error: iteration 4: saving checkpoint {re.escape(save)}/iter_0000004 "
        rf"failed: (?:{cause.format(save=re.escape(save))}); its partial iter_0000004.tmp was "
        rf"removed; the last checkpoint is {re.escape(save)}/iter_0000002", line), line
    assert stdout.split() == ["config.yaml", "iter_0000002", "latest_checkpointed_iteration.txt",
                              "mea-pretrain.log", "metrics.jsonl"], stdout


def _train_with_file_size_limit(rank, world_size, argv, limited_rank, limit):
    """Train; after the first checkpoint, rank `limited_rank` may write files of `limit` bytes
    only ("metrics": the size metrics.jsonl has then). Returns the RunFailure's line."""
    import resource

    from megatron_mea.apps.training import errors, loop
    from megatron_mea.apps.training.arguments import parse_run

    save = loop.Trainer.save

    def save_then_limit(self, root):
        save(self, root)
        if rank == limited_rank:
            size = (os.path.getsize(os.path.join(root, "metrics.jsonl")) if limit == "metrics"
                    else limit)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

    loop.Trainer.save = save_then_limit
    try:
        loop.pretrain(*parse_run(argv))
    except errors.RunFailure as exc:
        return str(exc)
    finally:  # the harness writes this rank's result to a file
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    return None


def test_a_save_failing_on_one_rank_stops_every_rank_at_tp2(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "4", "--save", save, "--save-interval", "2",
            "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    lines = run_distributed(_train_with_file_size_limit, 2, argv, 1, 20000)
    # Rank 0 coordinates the writer and holds rank 1's error (torch's archive writer reports
    # the short write as "unexpected pos"; rank 0 cannot see rank 1's limit, so it names both
    # causes); rank 1 learns that the save failed.
    assert re.fullmatch(rf"iteration 4: saving checkpoint {re.escape(save)}/iter_0000004 failed: "
                        r"rank 1: a write failed \(a full disk, or a file-size limit: "
                        r"ulimit -f\) \(the writer's words: .+\); its partial iter_0000004.tmp "
                        r"was removed; "
                        rf"the last checkpoint is {re.escape(save)}/iter_0000002", lines[0]), lines
    cause = lines[0][lines[0].index("rank 1: "):lines[0].index("; its partial")]
    assert lines[1] == lines[0].replace(cause, "the checkpoint writer failed on another rank")
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]


def test_a_metrics_write_that_fails_ends_in_one_line_keeping_whole_lines(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "4", "--save", save, "--save-interval", "2"]
    line = run_distributed(_train_with_file_size_limit, 1, argv, 0, "metrics")[0]
    metrics = os.path.join(save, "metrics.jsonl")
    assert re.fullmatch(
        rf"iteration 3: writing {re.escape(metrics)} failed: File too large; the last "
        rf"checkpoint is {re.escape(save)}/iter_0000002", str(line)), line
    with open(metrics) as handle:
        assert [json.loads(line)["iteration"] for line in handle] == [1, 2]


def _train_changing_data(rank, world_size, argv, prefix, how):
    """Train; right after the first checkpoint the data at `prefix` is changed in place
    (`how`). Returns the RunFailure's line."""
    from megatron_mea.apps.training import errors, loop
    from megatron_mea.apps.training.arguments import parse_run

    save = loop.Trainer.save

    def save_then_change(self, root):
        save(self, root)
        if how == "truncated .bin":
            os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") // 2)
        else:  # another dataset's index written over this one, in place, at the same size
            with open(prefix + ".other.idx", "rb") as other, open(prefix + ".idx", "r+b") as idx:
                idx.write(other.read(os.path.getsize(prefix + ".idx")))

    loop.Trainer.save = save_then_change
    try:
        loop.pretrain(*parse_run(argv))
    except errors.RunFailure as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how,culprit,change", [
    ("truncated .bin", ".bin", r"changed under the running job \(\d+ bytes when the run loaded "
                               r"it, \d+ now\)"),
    ("overwritten .idx", ".idx", r"rewritten under the running job \(modified after the run "
                                 r"loaded it\)"),
], ids=["truncated-bin", "overwritten-idx"])
def test_data_changed_under_a_running_job_ends_in_one_line_naming_the_file(
    tmp_path, how, culprit, change
):
    prefix, save = str(tmp_path / "data" / "corpus"), str(tmp_path / "ckpt")
    _write_data(prefix + ".other", [f"other {i} " * (1 + i % 4) for i in range(300)])
    _write_data(prefix, [f"document {i} " * (4 + i % 9) for i in range(200)])
    argv = [*_data_argv(prefix, str(tmp_path / "cache")), "--train-iters", "4", "--save", save,
            "--save-interval", "1"]
    line = run_distributed(_train_changing_data, 1, argv, prefix, how)[0]
    assert re.fullmatch(rf"iteration 2: {re.escape(prefix + culprit)}: {change}; the last "
                        rf"checkpoint is {re.escape(save)}/iter_0000001", str(line)), line
