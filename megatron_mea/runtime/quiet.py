"""Warning filters of the command-line tools.

On a machine without Transformer Engine, Apex or CUDA, Megatron-Core announces each fallback it
takes (about ten lines at import time, and some on every layer or config built); every tool
would print them before its own output, `--help` included. The tools install these filters
before Megatron is imported (`megatron_mea.cli` does, on import). Library code never calls this:
a program that imports `megatron_mea` itself keeps every warning.
"""

import logging
import re
import warnings

# (category, message regex) of notices that are expected and harmless for these tools.
HARMLESS_WARNINGS = (
    # Megatron-Core at import: the pure-torch fallbacks for Transformer Engine / Apex kernels.
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
    # Megatron-Core 0.16 on every TransformerConfig: its own default `cuda_graph_scope`.
    (UserWarning, r"full scope is deprecated"),
    # Megatron-Core with sequence parallelism, once per layer: a CUDA tuning hint.
    (UserWarning, r".*CUDA_DEVICE_MAX_CONNECTIONS"),
    # torch, on every call of the collectives Megatron-Core still uses under their old names.
    (FutureWarning, r".*is deprecated"),
    # torch, on every ShardedTensor Megatron-Core's dist-checkpoint loader builds (mea-generate).
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # torch's distributed checkpoint, on each single-process save / load of the converters.
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized"),
)
# Loggers whose warnings are CPU-only noise: torch logs a missing CUDA runtime when Megatron-Core
# imports `torch.utils.cpp_extension` (no extension is built by these tools).
HARMLESS_LOGGERS = ("torch.utils.cpp_extension",)
# (logger, message regex) of log records to drop: Megatron-Core 0.19's notices, on every model
# built and on the first checkpoint saved, about APIs this package uses on purpose.
HARMLESS_LOG_RECORDS = (
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated"),
)


class _DropMessage(logging.Filter):
    """Drops the records whose message matches `pattern` (a regex, matched at the start)."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return re.match(self.pattern, record.getMessage()) is None


def quiet_warnings() -> None:
    """Ignore `HARMLESS_WARNINGS`, raise `HARMLESS_LOGGERS` to ERROR and drop
    `HARMLESS_LOG_RECORDS`, for this process. Calling it again changes nothing.

    Call it before Megatron-Core is imported: its import-time warnings fire once.
    """
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in HARMLESS_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, pattern in HARMLESS_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))
