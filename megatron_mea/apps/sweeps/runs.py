"""Running an LR sweep: one `mea-pretrain` process per (variant, lr), resumable.

Layout under the sweep's output directory:

    sweep.json                   the shared training settings (a rerun with others is refused)
    train.yaml                   the `mea-pretrain --config` file every run uses
    cache/                       Megatron's dataset index cache, shared: every run sees the same
                                 samples in the same order (same seed, same data, same split)
    runs/<variant>/lr<lr>/       one run: `mea-pretrain --save` directory (checkpoints,
                                 config.yaml, metrics.jsonl), train.log (its output) and
                                 result.json, written when the run has ended

A run with `result.json` is finished and never retrained. A run without it resumes from its last
checkpoint (`--load`); the `metrics.jsonl` lines after that checkpoint's iteration are dropped
first, since the resumed run writes them again. A run with no checkpoint starts afresh.

The presets set `nan_policy=stop`: a non-finite loss or grad norm ends that run (exit status 1,
"stopped" in result.json) and the sweep goes on; under `skip` the NaN steps are recorded and the
run goes on (until `nan_max_consecutive_skips`). Any other failure of `mea-pretrain` raises
`SweepRunError` and leaves the run unfinished, to be retried on a rerun.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import yaml

import megatron_mea
from megatron_mea.apps.sweeps.sweep import VARIANTS
from megatron_mea.checkpoint.torch_dist.layout import latest_iteration
from megatron_mea.runtime.files import atomic_write

RESULT = "result.json"
METRICS = "metrics.jsonl"
LOG = "train.log"
# `mea-pretrain` prints this line (exit status 1) when TrainingStopped ends a run on purpose.
_STOPPED = "mea-pretrain: stopped:"
# mea-pretrain's module, run as `python -m` (a checkout need not be installed).
PRETRAIN_MODULE = "megatron_mea.cli.pretrain"


class SweepRunError(RuntimeError):
    """A run failed for a reason other than a non-finite value; the message names its log."""


@dataclass
class SweepSettings:
    """Everything shared by the runs of one sweep.

    Args:
        out: the sweep's output directory.
        data_path: `--data-path` of every run (Megatron blend syntax).
        train_config: `mea-pretrain` settings (PretrainArgs field: value) shared by all runs;
            `lr` and `min_lr` are set per run.
        variants: names from `megatron_mea.apps.sweeps.sweep.VARIANTS`.
        lrs: peak learning rates.
        min_lr_ratio: each run decays to `min_lr = lr x min_lr_ratio`. Default: 0.1.
    """

    out: str
    data_path: List[str]
    train_config: Dict[str, object]
    variants: List[str]
    lrs: List[float]
    min_lr_ratio: float = 0.1
    extra_flags: List[str] = field(default_factory=list)
    """Appended to every command (e.g. `--no-progress-bar`); not part of the fingerprint."""

    def __post_init__(self):
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"variants: unknown {unknown}; choose from {list(VARIANTS)}")
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ValueError(f"lrs ({self.lrs}) must be a non-empty list of positive numbers")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")

    @property
    def train_iters(self) -> int:
        """Planned steps of every run."""
        return int(self.train_config["train_iters"])

    @property
    def warmup_steps(self) -> int:
        """LR warm-up steps of every run: `lr_warmup_iters`, else Megatron's fraction x
        train_iters, rounded down."""
        if self.train_config.get("lr_warmup_iters") is not None:
            return int(self.train_config["lr_warmup_iters"])
        return int(float(self.train_config.get("lr_warmup_fraction", 0.0)) * self.train_iters)

    def grid(self) -> List[tuple]:
        """(variant, lr) pairs in run order: LR by LR, ascending, every variant at each."""
        return [(v, lr) for lr in sorted(self.lrs) for v in self.variants]


def run_dir(out: str, variant: str, lr: float) -> str:
    """`<out>/runs/<variant>/lr<lr>` (lr written with `%g`, e.g. lr0.003)."""
    return os.path.join(out, "runs", variant, f"lr{lr:g}")


def _fingerprint(settings: SweepSettings) -> dict:
    """What must not change between invocations on one directory (JSON round-tripped, so it
    compares equal to what a later invocation reads back)."""
    data = {
        "data_path": settings.data_path,
        "train_config": settings.train_config,
        "min_lr_ratio": settings.min_lr_ratio,
    }
    return json.loads(json.dumps(data))


def prepare_sweep(
    settings: SweepSettings, validate: Optional[Callable[[str], None]] = None
) -> str:
    """Create the output directory and `train.yaml`; refuse a directory of another sweep.

    `validate(config_path)` runs after `train.yaml` is written and before the settings are
    recorded in `sweep.json`, so settings that fail it are not recorded. Returns the path of
    `train.yaml`.

    Raises:
        ValueError: when `<out>/sweep.json` holds different training settings (naming them), or
            from `validate`.
    """
    os.makedirs(settings.out, exist_ok=True)
    fingerprint = _fingerprint(settings)
    path = os.path.join(settings.out, "sweep.json")
    saved = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            saved = json.load(handle)
        changed = _differences(saved, fingerprint)
        if changed:
            raise ValueError(
                f"{settings.out} holds a sweep with other settings ({', '.join(changed)}); "
                "its runs would not be comparable: use another --out or restore the settings"
            )
    config_path = os.path.join(settings.out, "train.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(settings.train_config, handle, sort_keys=False)
    if validate is not None:
        validate(config_path)
    if saved is None:
        _write_json(path, fingerprint)
    return config_path


def load_sweep(out: str) -> SweepSettings:
    """The settings of the sweep in `out`, with every variant and LR that has a run directory.

    Raises:
        ValueError: when `out` holds no sweep.
    """
    path = os.path.join(out, "sweep.json")
    if not os.path.exists(path):
        raise ValueError(f"{out}: no sweep here (no sweep.json)")
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    variants, lrs = discover_runs(out)
    if not variants:
        raise ValueError(f"{out}: the sweep has no runs yet")
    return SweepSettings(out=out, variants=variants, lrs=lrs, **saved)


def discover_runs(out: str) -> tuple:
    """(variants, lrs) that have a run directory under `<out>/runs`, variants in VARIANTS order."""
    root = os.path.join(out, "runs")
    variants, lrs = [], set()
    for variant in VARIANTS:
        directory = os.path.join(root, variant)
        found = [float(name[2:]) for name in (os.listdir(directory) if os.path.isdir(directory)
                                              else []) if name.startswith("lr")]
        if found:
            variants.append(variant)
            lrs.update(found)
    return variants, sorted(lrs)


def _differences(saved: dict, current: dict) -> List[str]:
    changed = [k for k in ("data_path", "min_lr_ratio") if saved.get(k) != current.get(k)]
    old, new = saved.get("train_config", {}), current["train_config"]
    keys = sorted(set(old) | set(new))
    changed += [f"train_config.{k}" for k in keys if old.get(k) != new.get(k)]
    return changed


def _write_json(path: str, data) -> None:
    with atomic_write(path) as handle:
        json.dump(data, handle, indent=1)


def read_metrics(directory: str) -> List[dict]:
    """The records of `<directory>/metrics.jsonl` ([] if absent); a torn last line is ignored."""
    path = os.path.join(directory, METRICS)
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def read_result(directory: str) -> Optional[dict]:
    """The run's `result.json`, or None while the run is unfinished."""
    path = os.path.join(directory, RESULT)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def resume_point(directory: str) -> int:
    """Make an unfinished run resumable; returns the iteration it restarts from (0: afresh).

    Keeps the `metrics.jsonl` records up to the last checkpoint's iteration and drops the rest.
    """
    start = (latest_iteration(directory) or 0) if os.path.isdir(directory) else 0
    kept = [r for r in read_metrics(directory) if r["iteration"] <= start]
    if os.path.isdir(directory):
        with atomic_write(os.path.join(directory, METRICS)) as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)
    return start


def train_command(settings: SweepSettings, config_path: str, variant: str, lr: float,
                  resume: bool) -> List[str]:
    """The `python -m megatron_mea.cli.pretrain` (mea-pretrain) command of one run."""
    directory = run_dir(settings.out, variant, lr)
    command = [
        sys.executable, "-m", PRETRAIN_MODULE, "--config", config_path,
        "--data-path", *settings.data_path,
        "--lr", f"{lr:g}", "--min-lr", f"{lr * settings.min_lr_ratio:g}",
        "--save", directory, "--data-cache-path", os.path.join(settings.out, "cache"),
        *VARIANTS[variant], *settings.extra_flags,
    ]
    if resume:
        command += ["--load", directory]
    return command


def train_run(settings: SweepSettings, config_path: str, variant: str, lr: float,
              on_step: Optional[Callable[[int], None]] = None, poll_s: float = 2.0) -> dict:
    """Train one run to its end (or resume it) and write its `result.json`; returns that.

    A finished run is returned as is. `on_step(iteration)` is called as `metrics.jsonl` grows
    (polled every `poll_s` seconds). Interrupting this call (Ctrl-C) terminates the trainer.

    Raises:
        SweepRunError: `mea-pretrain` failed other than by stopping on a non-finite value.
    """
    directory = run_dir(settings.out, variant, lr)
    done = read_result(directory)
    if done is not None:
        return done
    start = resume_point(directory)
    os.makedirs(directory, exist_ok=True)
    command = train_command(settings, config_path, variant, lr, resume=start > 0)
    log_path = os.path.join(directory, LOG)
    began = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        try:
            seen = start
            while process.poll() is None:
                time.sleep(poll_s)
                seen = _report_progress(directory, seen, on_step)
            _report_progress(directory, seen, on_step)
        except BaseException:
            process.terminate()
            process.wait()
            raise
    stop_message = _stop_message(log_path) if process.returncode == 1 else ""
    if process.returncode != 0 and "non-finite" not in stop_message:
        raise SweepRunError(
            f"{variant} lr={lr:g}: mea-pretrain exited with status {process.returncode}; "
            f"see {log_path}"
        )
    result = {
        "variant": variant,
        "lr": lr,
        "status": "stopped" if stop_message else "completed",
        "stop_message": stop_message,
        "resumed_from": start,
        "seconds": round(time.perf_counter() - began, 1),
        "command": command,
    }
    _write_json(os.path.join(directory, RESULT), result)
    return result


# Rendezvous variables of a launcher (torchrun, or a process that already joined a group): each
# run is a world of its own and picks a free port, so none of them is passed on.
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def child_env() -> dict:
    """This environment without rendezvous variables, with the directory holding `megatron_mea`
    first on PYTHONPATH, so that `python -m megatron_mea.cli.pretrain` finds this package from a
    checkout that is not installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_mea.__file__)))
    path = os.environ.get("PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    return {**env, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _report_progress(directory: str, seen: int, on_step) -> int:
    if on_step is None:
        return seen
    records = read_metrics(directory)
    latest = records[-1]["iteration"] if records else seen
    if latest > seen:
        on_step(latest)
    return max(seen, latest)


def _stop_message(log_path: str) -> str:
    """The last `mea-pretrain: stopped:` message of a run's log ("" if none)."""
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        lines = [line for line in handle if line.startswith(_STOPPED)]
    return lines[-1][len(_STOPPED):].strip() if lines else ""


def write_summary(out: str, table: str) -> str:
    """Keep a tool's summary `table` as `out/summary.txt` (what `mea-demo` and `mea-lr-sweep`
    print); returns the path."""
    path = os.path.join(out, "summary.txt")
    with atomic_write(path) as handle:
        handle.write(table + "\n")
    return path
