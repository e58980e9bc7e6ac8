"""How a `mea-pretrain` run ends other than by finishing: each error's message is one line, and
`mea-pretrain` turns each into its exit status (`megatron_mea.cli.pretrain`)."""


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
