# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

from megatron.training.config.common_config import (
    RNGConfig,
    ProfilingConfig,
    DistributedInitConfig,
)
from megatron.training.config.training_config import (
    TrainingConfig,
    ValidationConfig,
    SchedulerConfig,
    LoggerConfig,
    CheckpointConfig,
    TokenizerConfig,
)
from megatron.training.config.resilience_config import (
    FaultInjectorConfig,
    RerunStateMachineConfig,
    StragglerDetectionConfig,
)
from megatron.training.config.inference_config import InferenceSetupConfig

from megatron.training.config.container import InferenceConfigContainer, PretrainConfigContainer
from megatron.training.config.instantiate_utils import TargetAllowlist, target_allowlist
