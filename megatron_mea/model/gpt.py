"""The GPT model of a run: its `MEATransformerConfig`, the model of one pipeline stage, and the
process group and parallel state it runs in.

The trainer, the converters and inference build their models here from a `RunArgs` (the model
description of `megatron_mea.model.args` with the layout, precision and implementation), so a
checkpoint's model is the same model whoever builds it.
"""

from typing import Literal, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from torch.overrides import TorchFunctionMode

from megatron_mea.config import MEATransformerConfig
from megatron_mea.cpu import init_cpu_rng_tracker
from megatron_mea.model.args import RunArgs, config_fields, gpt_model_kwargs, parallel_sizes
from megatron_mea.model.fusions import fusion_settings
from megatron_mea.runtime.process_groups import start_process_groups
from megatron_mea.specs import get_gpt_decoder_block_spec

__all__ = ["build_model", "initialize", "transformer_config"]


def transformer_config(
    args: RunArgs, on_gpu: Optional[bool] = None, *, meta: bool = False
) -> MEATransformerConfig:
    """Translate the run's arguments into an `MEATransformerConfig` (validates the variant).

    Build it once per run or conversion and pass it down: every construction validates again.

    Args:
        args: the run's arguments (the config does not depend on the number of processes or
            on the vocabulary: the model builder takes those).
        on_gpu: pick the fusions for a CUDA run (see `megatron_mea.model.fusions`). Default: whether
            CUDA is available; tests pass True to build a GPU run's exact configuration on CPU.
        meta: for a model on the meta device (`build_model(..., placement="meta")`): CPU
            initialisation that draws no weights. Default: False.
    """
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    architecture = config_fields(args)
    fields = dict(
        **architecture,
        **parallel_sizes(args),
        # Megatron-LM's defaults: the interleaved schedule overlaps its p2p transfers (which
        # also lets two pipeline ranks exchange several tensors per step); the others batch them.
        overlap_p2p_comm=args.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        **fusion_settings(on_gpu, architecture["normalization"]),
    )
    if meta:
        fields.update(use_cpu_initialization=True, perform_initialization=False)
    return MEATransformerConfig(**fields)


class _AllOnMeta(TorchFunctionMode):
    """Every tensor made or moved inside goes to the meta device, whatever device is named.

    `torch.device("meta")` alone only covers factory calls without a device; some modules build
    a small init on CPU and move it (`init.to(device=...)`), which fails for a meta init.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = "meta"
        if func is torch.Tensor.to:
            args = tuple("meta" if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


def build_model(
    args: RunArgs,
    config: MEATransformerConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    *,
    core_attention: Optional[str] = None,
    placement: Literal["run", "built", "meta"] = "run",
):
    """The GPT model of this pipeline stage (of its model chunk `vp_stage` with virtual pipeline
    stages), with the plugin's block spec: the one GPT builder of the plugin's tools (training,
    inference, the converters, the benchmarks).

    Args:
        args: the model (`gpt_model_kwargs`) and its layer implementation (`transformer_impl`).
        config: `transformer_config(args)` (`meta=True` for `placement="meta"`).
        pre_process: this stage holds the embedding. Default: True.
        post_process: this stage holds the output layer. Default: True.
        vp_stage: the model chunk. Default: None (no virtual pipeline).
        core_attention: the local spec's core attention. Default: `args.core_attention`.
        placement: `run` (the run's device: the current CUDA device when there is one, in
            Megatron's `Float16Module` for bf16; training and inference), `built` (where
            Megatron builds it, unwrapped; the converters and the benchmarks) or `meta` (on the
            meta device, unwrapped: keys and shapes with no memory for the weights).
            Default: `run`.
    """
    kwargs = dict(
        config=config,
        **gpt_model_kwargs(args),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )
    kwargs["transformer_layer_spec"] = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=args.transformer_impl == "transformer_engine",
        vp_stage=vp_stage,
        core_attention=core_attention or args.core_attention,
    )
    if placement == "meta":
        with torch.device("meta"), _AllOnMeta():
            return GPTModel(**kwargs)
    model = GPTModel(**kwargs)
    if placement == "run" and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
        if args.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
    return model


def initialize(args: RunArgs, timeout_minutes: Optional[float] = None) -> None:
    """Process group (NCCL on GPUs, gloo on CPU), Megatron's parallel state and seeds.

    Without CUDA, call it inside `megatron_mea.cpu.megatron_on_cpu()` (the CLIs do).

    Args:
        args: the run's layout and seed.
        timeout_minutes: how long any collective waits for the other ranks before it fails
            (`--distributed-timeout-minutes`). Default: None, torch's and Megatron's defaults.
    """
    on_gpu = torch.cuda.is_available()
    start_process_groups("nccl" if on_gpu else "gloo", parallel_sizes=parallel_sizes(args),
                         timeout_minutes=timeout_minutes)
    # Same seed on every rank: replicated parameters start identical (Megatron-LM offsets the
    # seed by pipeline stage only).
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    else:
        init_cpu_rng_tracker(seed)
