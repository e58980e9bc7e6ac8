# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.
# ruff: noqa: F403

from .api import *
from .inference_interface import *
