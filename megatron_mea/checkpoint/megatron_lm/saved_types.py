"""The types Megatron-LM's saved arguments and common state hold, besides tensors.

Declared once for the two readers that must admit them: the pickle scan of every checkpoint
(`torch_dist.safe_pickle`, which lets them through without building them) and the reading of
Megatron-LM's arguments (`reading`, which builds inert stand-ins for the classes).
"""

import argparse
import io
import pathlib
import types

# The containers Megatron-LM's saved arguments and common state hold, read as themselves.
MEGATRON_LM_ARGUMENT_CONTAINERS = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath,
                                   io.BytesIO)

# Classes of Megatron-Core (and the standard library) that Megatron-LM's saved arguments and
# common state hold, at core_v0.16.1 and core_v0.19.0 (Megatron-Core's own
# `dist_checkpointing.safe_globals` list): enum members, the optimizer config, the rerun state
# machine's state. `reading` reads them as inert stand-ins, never importing them.
MEGATRON_LM_ARGUMENT_CLASSES = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "signal.Signals",
)
