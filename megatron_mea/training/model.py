"""Training side of `mea-pretrain`'s model: DDP, optimizer, scheduler (the config and the GPT
model itself are the library's, `megatron_mea.gpt`)."""

import logging

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mea.training.arguments import PretrainArgs

logger = logging.getLogger(__name__)

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


def wrap_ddp(args: PretrainArgs, config, model, disable_bucketing=False) -> DistributedDataParallel:
    """Megatron's DDP: fp32 gradient buffers, bucketed all-reduce, optional distributed optimizer
    (`disable_bucketing` for every model chunk but the first, as Megatron-LM does)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return DistributedDataParallel(config, ddp_config, model, disable_bucketing=disable_bucketing)


def build_optimizer(args: PretrainArgs, model_chunks):
    """Megatron's optimizer (Adam, Megatron's no-decay rules for biases and 1-D params), with the
    plugin matrices optionally exempt from decay."""
    opt_config = OptimizerConfig(
        optimizer="adam",
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        **{name: getattr(args, name) for name in OPTIMIZER_FIELDS},
    )
    overrides = get_standard_config_overrides(opt_config)
    if args.no_decay_plugin_matrices:
        overrides[ParamKey(name=PLUGIN_MATRICES)] = {"wd_mult": 0.0}
    return get_megatron_optimizer(opt_config, model_chunks, config_overrides=overrides)


def build_scheduler(args: PretrainArgs, optimizer) -> OptimizerParamScheduler:
    """Linear warm-up over `args.warmup_iters` steps, then decay to `min_lr` (in steps)."""
    warmup = args.warmup_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=args.train_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
