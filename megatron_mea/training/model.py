"""Model side of `mea-pretrain`: the transformer config, the GPT model, DDP, optimizer, scheduler."""

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mea import MEATransformerConfig, get_gpt_decoder_block_spec
from megatron_mea.fusions import fusion_settings
from megatron_mea.training.arguments import PretrainArgs
from megatron_mea.variant import variant_settings

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
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        qk_layernorm=args.qk_layernorm,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=False,
        init_method_std=args.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
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
        **fusion_settings(on_gpu, args.normalization),
        **variant_settings(args),
    )
    if args.num_experts:
        fields.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or fields["ffn_hidden_size"],
            moe_layer_freq=args.moe_layer_freq,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=args.moe_grouped_gemm,
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
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
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
