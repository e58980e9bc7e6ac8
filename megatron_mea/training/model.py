"""Model side of `mea-pretrain`: the transformer config, the GPT model, DDP, optimizer, scheduler."""

import logging
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mea import MEATransformerConfig, get_gpt_decoder_block_spec
from megatron_mea.fusions import fusion_settings
from megatron_mea.training.arguments import PretrainArgs
from megatron_mea.model_args import config_fields, gpt_model_kwargs

logger = logging.getLogger(__name__)

# Parameters of the variants that are full matrices (identity-initialised); see docs/decisions.md,
# "Parametrisation and weight decay".
PLUGIN_MATRICES = ("*.head_mix.*", "*.knock.*")


def transformer_config(
    args: PretrainArgs, world_size: int = 1, on_gpu: Optional[bool] = None
) -> MEATransformerConfig:
    """Translate the run's arguments into an `MEATransformerConfig` (validates the variant).

    Args:
        args: the run's arguments.
        world_size: the number of processes.
        on_gpu: pick the fusions for a CUDA run (see `megatron_mea.fusions`). Default: whether
            CUDA is available; tests pass True to build a GPU run's exact configuration on CPU.
    """
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    architecture = config_fields(args)
    fields = dict(
        **architecture,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # Megatron-LM's defaults: the interleaved schedule overlaps its p2p transfers (which
        # also lets two pipeline ranks exchange several tensors per step); the others batch them.
        overlap_p2p_comm=args.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        **fusion_settings(on_gpu, architecture["normalization"]),
    )
    return MEATransformerConfig(**fields)


def build_model(
    args: PretrainArgs, config: MEATransformerConfig, pre_process, post_process, vp_stage=None
):
    """The GPT model of this pipeline stage (of its model chunk `vp_stage` with virtual pipeline
    stages), with the plugin's block spec."""
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, vp_stage=vp_stage, core_attention=args.core_attention
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        **gpt_model_kwargs(args),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
        if args.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
    return model


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
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
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
