"""Checkpoints in the layout Megatron-LM's `pretrain_gpt.py` writes, for the converter tests.

How faithful (until Megatron-LM's own training loop runs in CI):
- the arguments are Megatron-LM's at the tag: the launch flags parsed by the vendored table of
  Megatron-LM's parser (`megatron_mea.integrations.mlm_flags`, every flag with its type and
  default) plus the plugin's flags, with the defaults Megatron-LM's `validate_args` derives and
  its `padded_vocab_size` (`megatron_mea.integrations.dry_run.dry_run`), `params_dtype` as a
  `torch.dtype` and `attention_backend` as Megatron-Core's `AttnBackend` member, as
  `parse_args` leaves them: the `argparse.Namespace` Megatron-LM pickles into the checkpoint;
- the config is `core_transformer_config_from_args`' (`dry_run.build_config`) and the model is
  `gpt_builders.gpt_builder`'s `GPTModel` with the plugin's spec (the local spec: its
  `sharded_state_dict_keys_map` gives the Transformer Engine spec's tensor names);
- the state dict is `generate_state_dict`'s (`args`, `checkpoint_version` 3.0, `iteration`,
  `model` = the model's sharded state dict, an `rng_state` sharded object, the FLOP counter;
  no optimizer, as `--no-save-optim`), saved by the installed Megatron-Core's
  `dist_checkpointing.save` (torch_dist; `common.pt` on 0.16, the `common_state` object from
  0.17), with the tracker file `save_checkpoint` writes.
"""

import os

import torch
import torch.distributed as dist

from megatron_mea.cpu import init_cpu_rng_tracker

# Flags every fixture run passes: Megatron-LM's CPU-compatible settings (no fused kernels, CPU
# initialisation, the local spec) and a tiny mock-data run.
CPU_FLAGS = [
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--mock-data",
    "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "10", "--lr", "1e-4",
    "--ckpt-format", "torch_dist", "--no-save-optim", "--no-save-rng", "--seed", "1234",
]


def megatron_lm_args(argv, world_size, tag):
    """(args Namespace, config) as Megatron-LM's `parse_args` + `validate_args` and
    `core_transformer_config_from_args` make them at `tag`."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_mea.integrations.dry_run import dry_run

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as Megatron-LM's launch scripts set it
    result = dry_run(CPU_FLAGS + list(argv), world_size, tag=tag)
    args, config = result["args"], result["config"]
    if args.tokenizer_type == "HuggingFaceTokenizer":
        # Megatron-LM pads the tokenizer's size (its --vocab-size is for NullTokenizer only).
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(args.tokenizer_model))
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.padded_vocab_size = -(-size // multiple) * multiple
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    if isinstance(args.attention_backend, str):
        args.attention_backend = AttnBackend[args.attention_backend]
    return args, config


def _build(args, config):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_mea.specs import get_gpt_decoder_block_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    )


def _move_off_init(model, scale=0.05):
    """Move every parameter (and the routers' expert bias) off its initial value, the same on
    every rank for the same name and shape, as training would (identity mixes, unit norms and a
    zero expert bias would hide mistakes of the converters)."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.endswith(("weight", "bias")) or not tensor.is_floating_point():
                continue
            gen = torch.Generator().manual_seed(sum(map(ord, name)) + 7 * tensor.numel())
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            # The expert bias moves by whole units: enough to change which experts are chosen.
            step = 1.0 if name.endswith("expert_bias") else scale
            tensor.add_((step * noise).to(tensor.dtype))


def save_megatron_lm_checkpoint(rank, world_size, argv, tag, root, ids, iteration=5):
    """Worker: build the model of `argv` at its TP (the world), write its Megatron-LM checkpoint
    under `root`, and return its logits `[b, s, V]` on `ids` (gathered over TP)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    args, config = megatron_lm_args(argv, world_size, tag)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    init_cpu_rng_tracker(args.seed)
    model = _build(args, config)
    _move_off_init(model)
    model.eval()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=None, runtime_gather_output=True)
    args.iteration = iteration
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.sharded_state_dict(),
        "rng_state": ShardedObject(
            "rng_state", [{"torch_rng_state": torch.get_rng_state()}],
            (1, world_size), (0, tp_rank), replica_id=0,
        ),
        "num_floating_point_operations_so_far": 0,
    }
    directory = os.path.join(root, f"iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, directory)
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(iteration))
    dist.barrier()
    return logits.float()
