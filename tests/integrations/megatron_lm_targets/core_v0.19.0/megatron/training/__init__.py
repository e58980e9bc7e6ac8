# Copyright (c) 2024, NVIDIA CORPORATION. All rights reserved.

import torch

from .global_vars import get_args
from .global_vars import get_signal_handler
from .global_vars import get_tokenizer
from .global_vars import get_tensorboard_writer
from .global_vars import get_wandb_writer
from .global_vars import get_one_logger
from .global_vars import get_adlr_autoresume
from .global_vars import get_timers
from .initialize  import initialize_megatron
from .training import pretrain, get_model, get_train_valid_test_num_samples, set_startup_timestamps

from .utils import (print_rank_0,
                    is_last_rank,
                    print_rank_last)
