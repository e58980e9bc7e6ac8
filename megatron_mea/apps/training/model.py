"""Megatron-Core's settings for `mea-pretrain`'s model: DDP, optimizer and learning-rate schedule,
translated from the run's arguments (the config and the GPT model itself are the library's,
`megatron_mea.model.gpt`). Translations only: the trainer builds Megatron's objects from them."""

from typing import Tuple

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey

from megatron_mea.apps.training.arguments import PretrainArgs

# Parameters of the variants that are full matrices (identity-initialised); see docs/decisions.md,
# "Parametrisation and weight decay".
PLUGIN_MATRICES = ("*.head_mix.*", "*.knock.*")
# `PretrainArgs` fields that `OptimizerConfig` takes under the same name.
OPTIMIZER_FIELDS = (
    "lr",
    "min_lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "clip_grad",
    "bf16",
    "use_distributed_optimizer",
)


def ddp_config(args: PretrainArgs) -> DistributedDataParallelConfig:
    """Megatron's DDP: fp32 gradient buffers, bucketed all-reduce, optional distributed
    optimizer."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def optimizer_config(args: PretrainArgs) -> Tuple[OptimizerConfig, dict]:
    """Megatron's optimizer (Adam) and its per-parameter overrides (`config_overrides` of
    `get_megatron_optimizer`): Megatron's no-decay rules for biases and 1-D params, with the
    plugin matrices optionally exempt from decay."""
    config = OptimizerConfig(
        optimizer="adam",
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        **{name: getattr(args, name) for name in OPTIMIZER_FIELDS},
    )
    overrides = get_standard_config_overrides(config)
    if args.no_decay_plugin_matrices:
        overrides[ParamKey(name=PLUGIN_MATRICES)] = {"wd_mult": 0.0}
    return config, overrides


def schedule(args: PretrainArgs) -> dict:
    """`OptimizerParamScheduler`'s arguments besides the optimizer: linear warm-up over
    `args.warmup_iters` steps, then decay to `min_lr` (in steps)."""
    return dict(
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.warmup_iters,
        lr_decay_steps=args.train_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
