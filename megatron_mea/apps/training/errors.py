"""How a `mea-pretrain` run ends other than by finishing: each error's message is one line, and
`mea-pretrain` turns each into its exit status (`megatron_mea.cli.pretrain`); the texts that
name the checkpoint to resume from."""

import signal
from typing import Optional, Tuple

from megatron_mea.checkpoint.torch_dist.layout import checkpoint_dir


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite loss or grad norm under the `stop` policy)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited past `--distributed-timeout-minutes`; the message names the rank
    that stopped answering and the last checkpoint."""


class RunFailure(RuntimeError):
    """A write of the run failed while it trained (a checkpoint, `metrics.jsonl`): the message
    says what failed and names the last checkpoint (the CLI exits 1 with it, one line)."""


class TrainingInterrupted(RuntimeError):
    """A signal stopped the run after the step in flight (`--exit-signal-handler`); the message
    names the checkpoint saved.

    Args:
        signum: the signal (the CLI exits with 128 + signum, as the signal's default would).
        message: one line.
    """

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


# The run's own one-line ends (a timeout's words in one, e.g. a save's OS error "Connection
# timed out", do not make it a collective's timeout).
ONE_LINE = (TrainingStopped, CollectiveTimeout, RunFailure, TrainingInterrupted)


def last_checkpoint_text(last_checkpoint: Optional[Tuple[str, int]],
                         load: Optional[str] = None) -> str:
    """Names the run's newest checkpoint, (directory, iteration), loaded or saved (None: none
    yet; `load`: the --load the set-up has not read yet)."""
    if last_checkpoint is None:
        if load:  # set-up, before the checkpoint is loaded
            return f"no checkpoint of this run yet; --load {load} is untouched"
        return "no checkpoint of this run yet"
    return f"the last checkpoint is {checkpoint_dir(*last_checkpoint)}"


def last_good_checkpoint_text(last_checkpoint: Optional[Tuple[str, int]]) -> str:
    """Where to resume from after a non-finite streak (no checkpoint is saved inside one)."""
    if last_checkpoint is None:
        return "no checkpoint of this run before it"
    root, iteration = last_checkpoint
    return (f"the last good checkpoint is {checkpoint_dir(root, iteration)}: "
            f"resume from it with --load {root} --ckpt-step {iteration}")


def interrupted(signum: int, iteration: int, save: Optional[str], saved: bool,
                nan_streak: int, last_good: str) -> str:
    """The line that ends a run stopped by `signum` after `iteration` (`saved`: a checkpoint
    was written under `save`; else `last_good` says where to resume)."""
    name = signal.Signals(signum).name
    if not save:
        return (f"interrupted by {name} after iteration {iteration}; no --save, so no "
                "checkpoint was written")
    if not saved:
        return (f"interrupted by {name} after iteration {iteration}, inside a streak of "
                f"{nan_streak} non-finite steps, so not saved; {last_good}")
    return (f"interrupted by {name} after iteration {iteration}: saved checkpoint "
            f"{checkpoint_dir(save, iteration)}; resume with --load {save}")
