# Copyright (c) 2025 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

from .pass_at_evaluation_agent import PassAtEvaluationResponse
from .reward_only_agent import RewardOnlyEvaluationResponse
