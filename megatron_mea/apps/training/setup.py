"""The set-up of a `mea-pretrain` run: the values it derives from its arguments, once, before any
process group exists (`run_settings`), and the set-up steps that need the processes (the run
directories, the model chunks of this rank in Megatron's DDP with their optimizer, the datasets),
in the order the trainer calls them.

The trainer passes these values down: the data, the checkpoint and the model code receive
built settings, not the arguments.
"""

from dataclasses import dataclass
from functools import partial
from typing import List, Optional, Tuple

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mea.apps.training import run_dir
from megatron_mea.apps.training.arguments import PretrainArgs, data_cache_dir, dataset_prefixes
from megatron_mea.apps.training.model import ddp_config, optimizer_config, schedule
from megatron_mea.checkpoint.errors import CheckpointError
from megatron_mea.config import MEATransformerConfig
from megatron_mea.cpu import cuda_device_to_cpu
from megatron_mea.layers import enable_fold_cache, with_fold_flush
from megatron_mea.model.gpt import build_model

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


@dataclass
class RunSettings:
    """What a run derives from its arguments, built once by `run_settings`.

    Attributes:
        config: the model's config (the one of the run: the trainer adds its step hooks).
        ddp: Megatron's DDP config.
        optimizer: Megatron's optimizer config.
        optimizer_overrides: its per-parameter overrides (no weight decay on some).
        schedule: `OptimizerParamScheduler`'s arguments besides the optimizer.
        data_prefixes: the dataset files the run reads (checked, then watched); [] for mock data.
        data_cache: where the dataset index caches go (None: next to the data).
        train_samples: the samples the training split must hold.
        eval_samples: the samples the validation split must hold (every evaluation reads its own).
        moe_track_names: the MoE losses to report per step ([] without an auxiliary loss).
    """

    config: MEATransformerConfig
    ddp: DistributedDataParallelConfig
    optimizer: OptimizerConfig
    optimizer_overrides: dict
    schedule: dict
    data_prefixes: List[str]
    data_cache: Optional[str]
    train_samples: int
    eval_samples: int
    moe_track_names: List[str]


def run_settings(args: PretrainArgs, config: MEATransformerConfig) -> RunSettings:
    """The settings of the run `args` describes.

    Args:
        args: the run's validated arguments.
        config: the run's config, as validation built it (`parse_run`).
    """
    optimizer, overrides = optimizer_config(args)
    eval_runs = args.train_iters // args.eval_interval + 1
    reads_files = bool(args.data_path) and not args.mock_data
    aux_loss = (
        args.num_experts
        and args.moe_router_load_balancing_type in AUX_LOSS_TYPES
        and args.moe_aux_loss_coeff > 0
    )
    return RunSettings(
        ddp=ddp_config(args),
        optimizer=optimizer,
        optimizer_overrides=overrides,
        schedule=schedule(args),
        data_prefixes=dataset_prefixes(args.data_path) if reads_files else [],
        data_cache=data_cache_dir(args),
        train_samples=args.train_iters * args.global_batch_size,
        eval_samples=eval_runs * args.eval_iters * args.global_batch_size,
        moe_track_names=["load_balancing_loss"] if aux_loss else [],
        config=config,
    )


def claim_run_directories(args: PretrainArgs):
    """(lock on --save or None, whether --load has a checkpoint to load): rank 0 checks and
    locks, every rank raises the same RunDirectoryError (one line) if it refuses."""
    lock, loads, problem, unreadable = None, False, None, False
    if dist.get_rank() == 0:
        try:
            lock, loads = run_dir.claim_run_directories(args)
        except (run_dir.RunDirectoryError, CheckpointError) as exc:
            problem, unreadable = str(exc), isinstance(exc, CheckpointError)
    verdict = [(loads, problem, unreadable)]
    dist.broadcast_object_list(verdict, src=0)
    loads, problem, unreadable = verdict[0]
    if problem:
        raise (CheckpointError if unreadable else run_dir.RunDirectoryError)(problem)
    return lock, loads


def build_chunks(args: PretrainArgs, config: MEATransformerConfig) -> list:
    """This rank's model: its pipeline stage, as one chunk per virtual pipeline stage (one
    chunk without interleaving), as Megatron-LM builds it."""
    vp_size = args.virtual_pipeline_model_parallel_size
    stages = [None] if vp_size is None else range(vp_size)
    # Without virtual stages the first and last stage are the pipeline's own.
    return [
        build_model(
            args, config,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=stage is None, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=stage is None, vp_stage=stage),
            vp_stage=stage,
        )
        for stage in stages
    ]


def setup_model_and_optimizer(
    args: PretrainArgs, settings: RunSettings
) -> Tuple[list, MegatronOptimizer, OptimizerParamScheduler]:
    """This rank's model chunks in Megatron's DDP, their optimizer and its scheduler, as
    Megatron-LM's `setup_model_and_optimizer` builds them; the run's config gains the step's
    hooks (no_sync, the gradients' finalize, the loss scaling)."""
    config = settings.config
    # Bucketing for the first chunk only, as Megatron-LM does.
    model = [
        DistributedDataParallel(config, settings.ddp, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(build_chunks(args, config))
    ]
    with cuda_device_to_cpu():
        optimizer = get_megatron_optimizer(
            settings.optimizer, model, config_overrides=settings.optimizer_overrides
        )
    scheduler = OptimizerParamScheduler(optimizer, **settings.schedule)
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    # Folded projections (MEA's `weights` exchange, `kha_fold_linear`) fold once per step; the
    # flush sends the micro-batches' gradients through the fold before Megatron reduces them.
    # Models without such layers keep Megatron's finalize untouched.
    finalize = finalize_model_grads
    if sum(enable_fold_cache(chunk.module) for chunk in model):
        finalize = with_fold_flush(finalize_model_grads)
    config.finalize_model_grads_func = finalize
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler


def build_datasets(args: PretrainArgs, settings: RunSettings, tokenizer) -> tuple:
    """(train, validation) GPT datasets of the run; validation is None without evaluation
    (`--eval-iters 0`). Rank 0 builds first and writes the dataset index caches; the others
    read them."""
    from megatron_mea.data import build_gpt_datasets

    build = partial(
        build_gpt_datasets,
        args.data_path,
        args.split,
        args.seq_length,
        tokenizer,
        settings.train_samples,
        settings.eval_samples,
        0,
        args.seed,
        args.mock_data,
        settings.data_cache,
    )
    rank = dist.get_rank()
    if rank == 0:
        datasets = build()
    dist.barrier()
    if rank != 0:
        datasets = build()
    return datasets[0], None if args.eval_iters == 0 else datasets[1]
