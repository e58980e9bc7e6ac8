"""Load a `mea-pretrain` checkpoint for inference at any tensor-parallel size.

A run directory holds `config.yaml` (the run's arguments), `latest_checkpointed_iteration.txt`
and `iter_XXXXXXX/` torch_dist checkpoints (`megatron_mea.checkpoint.torch_dist.training_state`); a
Megatron-LM run directory has no `config.yaml`, its model is described by the arguments saved in
the checkpoint (`megatron_mea.checkpoint.megatron_lm.reading`). The model is rebuilt from the saved
arguments with the parallel layout replaced (TP as asked; PP, CP and EP 1; no sequence
parallelism; more vocabulary padding where TP needs it) and its weights are read through
`dist_checkpointing`, which reshards them from whatever layout they were saved at. What the
model cannot take at that TP is refused with a ValueError before any process group exists.
"""

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from megatron_mea.checkpoint.megatron_lm.reading import common_state_types
from megatron_mea.checkpoint.torch_dist import checks, layout
from megatron_mea.checkpoint.torch_dist.model_only import UNSHARDED_BUT_TP, ModelDescription
from megatron_mea.cpu import require_cpu_patches
from megatron_mea.model.args import RunArgs

logger = logging.getLogger(__name__)

@dataclass
class InferenceModel:
    """A model loaded for generation.

    Attributes:
        model: the GPTModel (this rank's TP shard), in eval mode.
        tokenizer: the run's tokenizer.
        args: the run's arguments with the inference layout.
        iteration: the checkpoint's training iteration.
        checkpoint: the `iter_XXXXXXX` directory read.
    """

    model: object
    tokenizer: object
    args: RunArgs
    iteration: int
    checkpoint: str


def find_run_checkpoint(path: str, iteration: int | None = None):
    """Find the run directory and the checkpoint to read.

    Args:
        path: a run directory (`--save` of `mea-pretrain`) or one of its `iter_XXXXXXX` folders.
        iteration: which checkpoint of a run directory. Default: the latest complete one.

    Returns:
        (run directory, checkpoint directory, iteration).

    Raises:
        FileNotFoundError: when there is no `config.yaml` or no such checkpoint.
        ValueError: when `iteration` contradicts an `iter_XXXXXXX` path.
    """
    root, iteration = layout.split_checkpoint_path(os.path.abspath(path), iteration)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such directory")
    if iteration is None:
        iteration = layout.latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"{root!r} has no {layout.TRACKER}: pass an iter_XXXXXXX directory or "
            "an iteration"
        )
    directory = layout.checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        raise FileNotFoundError(layout.missing_checkpoint(directory))
    if not os.path.isfile(os.path.join(root, "config.yaml")) and not os.path.isfile(
        os.path.join(directory, "metadata.json")
    ):
        raise FileNotFoundError(
            f"no config.yaml in {root!r} and no Megatron-LM checkpoint in {directory!r} (the "
            "run's saved arguments)"
        )
    return root, directory, iteration


def inference_args(args: RunArgs, tp: int) -> RunArgs:
    """The run's arguments with the inference layout: TP `tp`, everything else unsharded.

    A padding multiple that `tp` does not divide grows to their least common multiple: Megatron
    loads the embedding and output layer across a change of padding (rows past the saved ones
    are zeros), and generation never picks a row past the tokenizer's."""
    return dataclasses.replace(
        args, **UNSHARDED_BUT_TP, tensor_model_parallel_size=tp,
        make_vocab_size_divisible_by=math.lcm(args.make_vocab_size_divisible_by, tp),
    )


def check_tensor_parallel(config, tp: int) -> None:
    """Raise ValueError naming an MLP hidden size that TP cannot split (Megatron would only
    assert); heads and the variant's sizes are the config's own checks."""
    sizes = [("ffn_hidden_size", config.ffn_hidden_size)]
    if config.num_moe_experts:
        sizes.append(("moe_ffn_hidden_size", config.moe_ffn_hidden_size))
    for name, size in sizes:
        if size % tp:
            raise ValueError(f"{name} ({size}) must be divisible by the tensor-parallel size ({tp})")


def load_for_inference(
    checkpoint_dir: str, tp: int = 1, *, iteration: int | None = None
) -> InferenceModel:
    """Build the run's model at tensor-parallel size `tp`, load a checkpoint into it, and build
    the run's tokenizer.

    Initialises the process group if needed (a world of one when launched without torchrun) and
    (re)initialises Megatron's parallel state at TP `tp`; every rank of the world calls it, and
    the world size must be a multiple of `tp` (extra ranks are data-parallel replicas).

    Args:
        checkpoint_dir: a run directory or an `iter_XXXXXXX` folder of one.
        tp: tensor-parallel size to run at (independent of the size it was trained at).
        iteration: checkpoint of a run directory to read. Default: the latest.

    Returns:
        An `InferenceModel`.

    Raises:
        FileNotFoundError: no run directory, `config.yaml` or checkpoint where pointed.
        ValueError: the model cannot be split into `tp` (e.g. MEA with `mea_num_kv_components`
            not a multiple of `tp`), `tp` does not divide the world size, or the tokenizer has
            ids the model lacks.
        CheckpointError: a partial or corrupt checkpoint, or one of another model
            (`megatron_mea.checkpoint.torch_dist.checks.verify_checkpoint`).
    """
    from megatron_mea.data import build_tokenizer

    require_cpu_patches("load_for_inference")
    root, directory, iteration = find_run_checkpoint(checkpoint_dir, iteration)
    args = _inference_args_of(root, tp)
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ValueError(
            f"{root}: no tokenizer recorded (a Megatron-LM run is described with its tokenizer "
            "only when its tokenizer_type was HuggingFaceTokenizer; `load_model` loads the model "
            "alone)"
        )
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    if args.vocab_size is None:
        args.vocab_size = tokenizer.vocab_size
    if tokenizer.vocab_size > args.vocab_size:
        # generate() masks the logits from the tokenizer's size up: the model must have them all.
        raise ValueError(
            f"the tokenizer ({args.tokenizer_type}) has {tokenizer.vocab_size} ids, more than the "
            f"model's vocab_size ({args.vocab_size})"
        )
    model = _build_and_load(args, directory, tp)
    logger.info("loaded %s (iteration %d) at TP=%d", directory, iteration, tp)
    return InferenceModel(model, tokenizer, args, iteration, directory)


def load_model(checkpoint_dir: str, tp: int = 1, *, iteration: int | None = None):
    """The checkpoint's model alone (no tokenizer: e.g. a Megatron-LM run with its
    NullTokenizer), built and loaded as `load_for_inference` does.

    Returns:
        (the GPTModel in eval mode, the run's arguments with the inference layout).
    """
    require_cpu_patches("load_model")
    root, directory, iteration = find_run_checkpoint(checkpoint_dir, iteration)
    args = _inference_args_of(root, tp)
    if args.vocab_size is None:
        raise ValueError(f"{root}: no vocab_size recorded; load_for_inference takes it from the "
                         "run's tokenizer")
    return _build_and_load(args, directory, tp), args


def _inference_args_of(root: str, tp: int) -> RunArgs:
    if tp < 1:
        raise ValueError(f"tp ({tp}) must be >= 1")
    return inference_args(ModelDescription.load(root).args, tp)


def _build_and_load(args: RunArgs, directory: str, tp: int):
    """Check the layout, (re)initialise Megatron's parallel state, build the model at TP `tp` and
    read the checkpoint `directory` into it."""
    from megatron_mea.model.gpt import build_model, initialize, transformer_config

    # The model must split at this TP whatever the world: checked before the world size.
    config = transformer_config(args)
    check_tensor_parallel(config, tp)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world % tp:
        raise ValueError(
            f"tp ({tp}) must divide the world size ({world}); launch with torchrun "
            f"--nproc-per-node {tp} (or a multiple)"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize(args)
    model = build_model(args, config, pre_process=True, post_process=True)
    checks.verify_checkpoint(directory, model)
    with common_state_types():  # a Megatron-LM checkpoint's common state holds its arguments
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"])
    model.eval()
    return model
