"""The arguments Megatron-LM saves in a checkpoint, for the checkpoints this package writes.

Megatron-LM's `pretrain_gpt.py` reads a checkpoint's common state for its saved `args` (an
`argparse.Namespace`: `load_args_from_checkpoint` with `--use-checkpoint-args`, and
`load_checkpoint`'s checks, data position and what to load) and its `checkpoint_version`.
`mea-pretrain` and `mea-convert import-hf` write both, so Megatron-LM continues from their
checkpoints; `megatron_lm.reading` reads them back (`run_args_from_megatron_lm`).

Light at import (argparse and the model declaration only): the trainer imports it.
"""

import argparse

from megatron_mea.model.args import MODEL_FIELDS, derived_sizes

# What `RunArgs` says of the run under Megatron-LM's own names (the layout Megatron-LM checks
# with `--use-checkpoint-args`, the precision, the padded vocabulary).
_SAME_NAMED = (
    "padded_vocab_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "bf16",
)

# What Megatron-LM's `load_checkpoint` reads of a checkpoint's common state besides its saved
# arguments: the format version (below 3.0 it reorders the q/k/v rows and compares old names).
CHECKPOINT_VERSION = 3.0


def megatron_lm_arguments(args, *, optimizer_saved: bool) -> argparse.Namespace:
    """The saved arguments of a checkpoint this package writes, as Megatron-LM saves them: what
    `load_args_from_checkpoint` (`--use-checkpoint-args`, with the plugin's patch for the
    variant's fields) and `load_checkpoint` read. The inverse of `run_args_from_megatron_lm`.

    Args:
        args: the run's `RunArgs` (a description's, or `mea-pretrain`'s `PretrainArgs`).
        optimizer_saved: whether the checkpoint holds Megatron's optimizer state and scheduler.
            The RNG state is never Megatron-LM's (`no_save_rng`): Megatron-LM starts its own.

    No data consumed (`consumed_train_samples` 0): a training checkpoint's writer puts in its
    own position (`checkpoint.torch_dist.training_state.save_checkpoint`).
    """
    saved = {name: getattr(args, name) for name in MODEL_FIELDS}
    # Megatron-LM's validate_args fills these in before it saves them.
    saved.update(derived_sizes(args))
    saved.update({name: getattr(args, name) for name in _SAME_NAMED})
    saved.update(
        group_query_attention=args.num_query_groups not in (None, args.num_attention_heads),
        disable_bias_linear=not args.add_bias_linear,
        ckpt_format="torch_dist",
        no_save_optim=not optimizer_saved,
        no_save_rng=True,
        consumed_train_samples=0,
        # Megatron-LM takes a tokenizer from here only where there is one to take.
        tokenizer_type=args.tokenizer_type if args.tokenizer_model else None,
        tokenizer_model=args.tokenizer_model,
    )
    return argparse.Namespace(**saved)
