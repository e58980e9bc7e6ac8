"""The set-up of a `mea-pretrain` run: the values it derives from its arguments, once, before any
process group exists (`run_settings`), and the set-up steps that need the processes (the run
directories, the model chunks of this rank).

The trainer passes these values down: the data, the checkpoint and the model code receive
built settings, not the arguments.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from megatron_mea.config import MEATransformerConfig
from megatron_mea.gpt import build_model
from megatron_mea.checkpoint.torch_dist.checks import CheckpointError
from megatron_mea.training import run_dir
from megatron_mea.training.arguments import PretrainArgs, data_cache_dir, dataset_prefixes
from megatron_mea.training.model import ddp_config, optimizer_config, schedule

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
