"""The demo's training runs, `<out>/runs/<variant>`: what a rerun keeps, continues or starts
again, and the console each run shows (its progress bar, then one line).

`mea-demo` run again in the same `--out` (a second `make demo`) decides per variant:

- complete (its `demo.json` holds this demo's settings, its newest checkpoint is the last
  iteration and every file of it is as saved, per `checksums.json`): kept; its timing and greedy
  sample come from `demo.json`, nothing is trained or decoded again;
- halfway (same settings, an intact newest checkpoint before the last iteration: the demo was
  interrupted): continued with `mea-pretrain --load` from that checkpoint; the metrics recorded
  after it are dropped first, since they are trained again;
- anything else (no run yet, other settings such as another `--train-iters`, a damaged newest
  checkpoint): the directory is removed and the run starts afresh.

The demo owns `<out>/runs`, so it may remove a run there; `mea-pretrain` itself still refuses
to write over another run's checkpoints (`training.run_dir`). Each tool's console output goes to
the demo's log file; Megatron-Core's records to each run's `mea-pretrain.log`.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional, Tuple

from megatron_mea._optional import import_extra
from megatron_mea.checkpoint.torch_dist import integrity
from megatron_mea.checkpoint.errors import CheckpointError
from megatron_mea.checkpoint.torch_dist.layout import (
    checkpoint_dir,
    latest_iteration,
    saved_iterations,
)
from megatron_mea.apps.sweeps.runs import child_env, read_metrics, resume_point
from megatron_mea.runtime.files import atomic_write

RECORD = "demo.json"
SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 24
POLL_S = 0.5


class DemoError(RuntimeError):
    """A tool the demo ran failed; the message names it, its last line and the log."""


def read_record(directory: str) -> Optional[dict]:
    """The run's `demo.json` ({"settings", and once complete "seconds", "sample",
    "kv_bytes_per_token"}), or None."""
    path = os.path.join(directory, RECORD)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except ValueError:  # torn by a kill: the run is started again
        return None


def write_record(directory: str, record: dict) -> None:
    """Write the run's `demo.json` atomically."""
    with atomic_write(os.path.join(directory, RECORD)) as handle:
        json.dump(record, handle, indent=1)


def _intact(directory: str) -> bool:
    """Every file of a checkpoint directory is there with its saved size and CRC-32."""
    try:
        listed = integrity.read_checksums(directory)
        if listed is None:
            return False
        integrity.verify_checksums(directory, listed, sorted(listed))
    except integrity.IntegrityError:
        return False
    return True


def plan_run(directory: str, settings: dict, iters: int) -> Tuple[str, int, str]:
    """(action, iteration to start from, why) for one variant's run directory; the action is
    "keep", "continue" or "afresh" (module docstring)."""
    record = read_record(directory)
    if record is None:
        return "afresh", 0, "" if not os.path.exists(directory) else "no record of this demo"
    if record.get("settings") != settings:
        return "afresh", 0, "trained with other settings"
    try:
        latest = latest_iteration(directory)
    except CheckpointError:
        latest = None
    if latest is None:
        return "afresh", 0, "no checkpoint yet"
    if not _intact(checkpoint_dir(directory, latest)):
        return "afresh", 0, f"its checkpoint of iteration {latest} is damaged"
    if latest == iters and "sample" in record:
        return "keep", latest, ""
    return "continue", latest, ""


def train(name: str, command: list, directory: str, action: str, start: int, iters: int,
          settings: dict, log) -> float:
    """Run `mea-pretrain` (`command`, without `--load`) for one variant as `plan_run` decided,
    its output appended to `log`, a progress bar labelled `name` on the console; returns the
    seconds it took."""
    if action == "afresh":
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        write_record(directory, {"settings": settings})
    else:
        # Checkpoint directories after the newest complete one are a save the kill cut short.
        for later in saved_iterations(directory):
            if later > start:
                shutil.rmtree(checkpoint_dir(directory, later))
        resume_point(directory)
        command = [*command, "--load", directory]
    if start < iters:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
    tqdm = import_extra("tqdm", "the demo's progress bars").tqdm
    began = time.perf_counter()
    bar = tqdm(total=iters, initial=start, desc=name, unit="step", dynamic_ncols=True)
    try:
        if start < iters:
            _run_with_bar(command, directory, bar, start, log)
    finally:
        bar.close()
    return time.perf_counter() - began


def _run_with_bar(command: list, directory: str, bar, start: int, log) -> None:
    """Run `command` to its end, moving `bar` as `metrics.jsonl` grows."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    seen = start
    try:
        while True:
            running = process.poll() is None
            records = read_metrics(directory)
            if records and records[-1]["iteration"] > seen:
                bar.update(records[-1]["iteration"] - seen)
                bar.set_postfix(loss=f"{records[-1]['lm loss']:.3f}")
                seen = records[-1]["iteration"]
            if not running:
                break
            time.sleep(POLL_S)
    except BaseException:  # Ctrl-C: the run stops with the demo (a rerun continues it)
        process.terminate()
        process.wait()
        raise
    if process.returncode != 0:
        raise DemoError(f"{_tool(command)} exited with status {process.returncode}: "
                        f"{_last_line(log.name)} (the whole output: {log.name})")


def _tool(command: list) -> str:
    """`mea-<name>` of a `python -m megatron_mea.cli.<name> ...` command."""
    return "mea-" + command[2].rsplit(".", 1)[-1]


def _last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    return lines[-1] if lines else "no output"


def greedy_sample(directory: str, log) -> Tuple[str, int]:
    """(`SAMPLE_TOKENS` greedy bytes after `SAMPLE_PROMPT`, KV-cache bytes per token) of the
    run's checkpoint, through `mea-generate`: the cache it allocated for the prompt and the
    sample, over their tokens. Its output is appended to `log`."""
    command = [sys.executable, "-m", "megatron_mea.cli.generate", "--load", directory,
               "--prompt", SAMPLE_PROMPT, "--max-new-tokens", str(SAMPLE_TOKENS), "--no-stream",
               "--ignore-eod"]
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    run = subprocess.run(command, capture_output=True, text=True, env=child_env())
    log.write(run.stdout + run.stderr)
    log.flush()
    if run.returncode != 0:
        raise DemoError(f"{_tool(command)} exited with status {run.returncode}: "
                        f"{_last_line(log.name)} (the whole output: {log.name})")
    out = run.stdout
    marker = f"[0] {SAMPLE_PROMPT}"
    begin = out.index(marker) + len(marker)
    text = out[begin:out.index("\ncheckpoint: ", begin)]
    counts = re.search(r"generated (\d+) tokens from (\d+) prompt tokens", out)
    cache = re.search(r"KV cache: (\d+) bytes", out)
    tokens = int(counts.group(1)) + int(counts.group(2))
    return SAMPLE_PROMPT + text, int(cache.group(1)) // tokens


def completed(directory: str) -> dict:
    """The finished run's result for the summary: its `demo.json` and its metrics records."""
    return {**read_record(directory), "records": read_metrics(directory)}
