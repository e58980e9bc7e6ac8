"""What the command-line tools' console shows of Python's logging.

Megatron-Core logs at INFO what a library user may want and a tool's user cannot act on: whole
config objects (DDP, optimizer, dataset), one line per parameter of each gradient bucket, the
dataset builder's index steps (about 90 lines), Megatron-FSDP's import notices. The console
keeps this package's own records from INFO (progress, per-interval metrics, checkpoints saved)
and every logger's warnings and errors; the rest goes to a run's log file where the tool has a
run directory (`mea-pretrain`: `training.run_dir.RUN_LOG`), or nowhere.

An application's progress lines (`[demo] ...`, `[lr-sweep] ...`, `[bench] ...`) are INFO records
of its module's logger; the tool that runs it shows them on stdout as they are
(`print_progress`), and a program that calls the application itself keeps them in its logging.
"""

import logging
import sys

# The loggers whose INFO records are the tools' own messages.
OWN_LOGGER = "megatron_mea"


class ConsoleFilter(logging.Filter):
    """Passes `OWN_LOGGER`'s records from INFO, every other logger's from WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + ".")
        return own or record.levelno >= logging.WARNING


class _ConsoleHandler(logging.StreamHandler):
    """The handler `configure_console` installs (found again by its class, and replaced)."""


def configure_console(fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Log INFO and above to stderr through `ConsoleFilter`; the root logger is set to INFO so
    that a run's log file (a handler of its own) gets Megatron's INFO records too.

    Calling it again replaces the handler it installed (a tool run twice in one process, as
    tests do, writes to the current `sys.stderr`).

    Args:
        fmt: the console's record format. Default: level, logger and message.
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _ConsoleHandler)]:
        root.removeHandler(handler)
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(ConsoleFilter())
    root.addHandler(handler)
    root.setLevel(logging.INFO)


class _StdoutHandler(logging.StreamHandler):
    """Writes each record to the `sys.stdout` of the moment it is emitted (a test's captured
    stdout, or the one a tool run in-process later has), never to a stream closed since."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        """The stream is always the current `sys.stdout`; `StreamHandler.__init__` sets one."""


def print_progress(*loggers: str) -> None:
    """Show the INFO records of `loggers` (module names) on stdout, the message alone, as the
    tool's own output lines; they no longer reach the root logger. Calling it again changes
    nothing.

    Args:
        loggers: the names of the application modules whose progress the tool shows.
    """
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
            logger.addHandler(_StdoutHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
