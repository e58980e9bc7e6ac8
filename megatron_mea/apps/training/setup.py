"""The set-up of a `mea-pretrain` run: the values it derives from its arguments, once, before any
process group exists (`run_settings`: the tokenizer and the vocabulary, the data, what every
checkpoint records), and the set-up steps that need the processes (the run directories, the
model chunks of this rank in Megatron's DDP with their optimizer, the datasets), in the order
the trainer calls them.

The trainer passes these values down: the data and the checkpoint code receive built settings,
and nothing writes to the parsed arguments (the vocabulary resolved is in a copy,
`RunSettings.args`).
"""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Tuple

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
from megatron_mea.checkpoint.megatron_lm.writing import megatron_lm_arguments
from megatron_mea.checkpoint.torch_dist.saved_settings import data_settings
from megatron_mea.config import MEATransformerConfig
from megatron_mea.cpu import cuda_device_to_cpu
from megatron_mea.layers import enable_fold_cache, with_fold_flush
from megatron_mea.model.gpt import build_model

if TYPE_CHECKING:  # the data package is imported when the run is set up (it is heavy)
    from megatron_mea.data import DatasetSettings

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


@dataclass
class RunSettings:
    """What a run derives from its arguments, built once by `run_settings` before the model.

    Attributes:
        args: the run's arguments with the vocabulary resolved (`--vocab-size`, else the
            tokenizer's); the parsed arguments are left as parsed.
        config: the model's config (the one of the run: the trainer adds its step hooks).
        tokenizer: the run's tokenizer (`megatron_mea.data.build_tokenizer`).
        ddp: Megatron's DDP config.
        optimizer: Megatron's optimizer config.
        optimizer_overrides: its per-parameter overrides (no weight decay on some).
        schedule: `OptimizerParamScheduler`'s arguments besides the optimizer.
        data_prefixes: the dataset files the run reads (checked, then watched); [] for mock data.
        datasets: what `megatron_mea.data.build_gpt_datasets` builds: the training split holds
            the steps' samples, the validation split every evaluation's own, no test split.
        checkpoint_settings: what every checkpoint of the run records of it, compared on resume
            (`checkpoint.torch_dist.saved_settings.data_settings`).
        megatron_lm_args: the run's arguments as Megatron-LM saves them; each checkpoint adds
            its data position (`checkpoint.megatron_lm.writing.megatron_lm_arguments`).
        moe_track_names: the MoE losses to report per step ([] without an auxiliary loss).
    """

    args: PretrainArgs
    config: MEATransformerConfig
    tokenizer: object
    ddp: DistributedDataParallelConfig
    optimizer: OptimizerConfig
    optimizer_overrides: dict
    schedule: dict
    data_prefixes: List[str]
    datasets: "DatasetSettings"
    checkpoint_settings: dict
    megatron_lm_args: argparse.Namespace
    moe_track_names: List[str]


def run_settings(args: PretrainArgs, config: MEATransformerConfig) -> RunSettings:
    """The settings of the run `args` describes.

    Args:
        args: the run's validated arguments (not written to).
        config: the run's config, as validation built it (`parse_run`).
    """
    from megatron_mea.data import DatasetSettings, build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    if args.vocab_size is None:
        args = dataclasses.replace(args, vocab_size=tokenizer.vocab_size)
    optimizer, overrides = optimizer_config(args)
    eval_runs = args.train_iters // args.eval_interval + 1
    reads_files = bool(args.data_path) and not args.mock_data
    aux_loss = (
        args.num_experts
        and args.moe_router_load_balancing_type in AUX_LOSS_TYPES
        and args.moe_aux_loss_coeff > 0
    )
    datasets = DatasetSettings(
        data_prefix=args.data_path,
        split=args.split,
        seq_length=args.seq_length,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=eval_runs * args.eval_iters * args.global_batch_size,
        test_samples=0,
        seed=args.seed,
        mock=args.mock_data,
        cache_dir=data_cache_dir(args),
    )
    return RunSettings(
        args=args,
        config=config,
        tokenizer=tokenizer,
        ddp=ddp_config(args),
        optimizer=optimizer,
        optimizer_overrides=overrides,
        schedule=schedule(args),
        data_prefixes=dataset_prefixes(args.data_path) if reads_files else [],
        datasets=datasets,
        checkpoint_settings=data_settings(args),
        megatron_lm_args=megatron_lm_arguments(args, optimizer_saved=True),
        moe_track_names=["load_balancing_loss"] if aux_loss else [],
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
