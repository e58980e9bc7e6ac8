"""Refusing a checkpoint directory that cannot be loaded, before any collective load starts.

`verify_checkpoint` checks the files (partial, truncated, corrupt, unsafe to unpickle, written
by a newer Megatron-Core) and the model tensors against the model (another model's checkpoint).
Every message is one line naming the file or the tensor. Where checkpoints live is `layout`'s;
what a checkpoint records of its run, and the refusals built on it, `saved_settings`'.
"""

import json
import logging
import os
import re

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from megatron_mea import compat
from megatron_mea.checkpoint.errors import CheckpointError, ModelMismatchError
from megatron_mea.checkpoint.torch_dist import integrity
from megatron_mea.checkpoint.torch_dist.layout import missing_checkpoint
from megatron_mea.checkpoint.torch_dist.safe_pickle import UnsafePickleError

logger = logging.getLogger(__name__)

# Optimizer tensors (checkpoints of earlier versions prefix a ChainedOptimizer's with chained_N.).
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")


def chunks_of(model) -> list:
    """The model chunks of this rank (one, or one per virtual pipeline stage)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def verify_checkpoint(directory: str, model) -> None:
    """Refuse a partial, corrupt, foreign or unreadable checkpoint before any collective load.

    Every rank runs the same checks on the same files, so all of them raise together instead of
    some waiting forever in a collective. Checks: every file against its size and CRC-32 in
    `checksums.json` (the ranks share the reading); the `.metadata` index, `common.pt` and the
    byte objects in the shards hold only the types their formats need (`safe_pickle`: a crafted
    pickle is refused without running it); the directory, Megatron's `metadata.json` and
    the common state exist (a `common.pt` file up to Megatron-Core 0.16, a `common_state`
    object in the index from 0.17, which 0.16 cannot read); every byte range the torch_dist
    index points at lies inside an existing shard file (missing or truncated shards); the model
    tensors are exactly the ones this model expects, with the same global shapes (another
    model's checkpoint).

    Args:
        directory: an `iter_XXXXXXX` checkpoint directory.
        model: the model or its list of chunks (virtual pipeline stages).

    Raises:
        CheckpointError: naming the file or tensor and the problem (`ModelMismatchError` for
            tensors this model does not have or has in another shape); for a corrupt or unsafe
            file also the older complete checkpoint and how to load it (`--ckpt-step`).
    """
    if not os.path.isdir(directory):
        raise CheckpointError(missing_checkpoint(directory))
    for name in ("metadata.json", ".metadata"):
        if not os.path.exists(os.path.join(directory, name)):
            raise CheckpointError(f"{os.path.join(directory, name)}: missing (partial checkpoint)")
    _check_files(directory)
    _check_json(os.path.join(directory, "metadata.json"))
    _check_common_state(directory, index := _read_index(directory))
    try:
        _check_shard_files(directory, index)
        integrity.scan_pickles(directory, index)
    except (CheckpointError, UnsafePickleError) as exc:
        raise CheckpointError(f"{exc}; {integrity.fallback_hint(directory)}") from None
    saved = {key: tuple(meta.size) for key, meta in index.state_dict_metadata.items()
             if hasattr(meta, "size") and not OPTIMIZER_KEY.match(key)}
    problem, expected = _model_tensor_problem(directory, saved, chunks_of(model))
    # Each pipeline stage expects only its own layers: pool the verdicts and the expected keys,
    # so that every rank raises the same error (a rank raising alone would leave the others
    # waiting in the next collective).
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (problem, expected))
    problems = [p for p, _ in verdicts if p]
    if problems:
        raise ModelMismatchError(problems[0])
    extra = sorted(set(saved) - set().union(*(keys for _, keys in verdicts)))
    if extra:
        raise ModelMismatchError(
            f"{directory}: {len(extra)} tensors of the checkpoint are not in this model, e.g. "
            f"{extra[0]!r} (a checkpoint of another model?)"
        )


def _check_files(directory: str) -> None:
    """Every file of the checkpoint has the size and CRC-32 it was saved with (its
    `checksums.json`); the ranks share the reading and all raise the same error."""
    try:
        listed = integrity.read_checksums(directory)
    except integrity.IntegrityError as exc:
        raise CheckpointError(f"{exc}; {integrity.fallback_hint(directory)}") from None
    if listed is None:
        logger.warning("%s: no %s (saved by another tool or an earlier version): its files "
                       "cannot be checked for corruption", directory, integrity.CHECKSUMS)
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    try:
        integrity.verify_checksums(directory, listed, sorted(listed)[rank::world])
    except integrity.IntegrityError as exc:
        problem = str(exc)
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"{problems[0]}; {integrity.fallback_hint(directory)}")


def _check_json(path: str) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            json.load(handle)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _read_index(directory: str):
    """The `.metadata` index, unpickled from the types torch's format needs only (a crafted
    index is refused without running it)."""
    try:
        return integrity.read_index(directory)
    except UnsafePickleError as exc:
        raise CheckpointError(f"{exc}; {integrity.fallback_hint(directory)}") from None
    except OSError as exc:
        index_file = os.path.join(directory, ".metadata")
        raise CheckpointError(f"{index_file}: unreadable ({exc})") from exc


def _check_common_state(directory: str, index) -> None:
    common_file = os.path.join(directory, compat.COMMON_STATE_FILE)
    if os.path.exists(common_file):
        return
    if not any(key.startswith(compat.COMMON_STATE_KEY) for key in index.state_dict_metadata):
        raise CheckpointError(
            f"{common_file}: missing, and no {compat.COMMON_STATE_KEY!r} object in the index "
            "either (partial checkpoint)"
        )
    if not compat.reads_common_state_from_index():
        raise CheckpointError(
            f"{directory}: written by megatron-core 0.17 or later (its common state is stored "
            f"in the index, not in {compat.COMMON_STATE_FILE}), which megatron-core "
            f"{compat.MEGATRON_CORE_VERSION} cannot read: load it with megatron-core 0.17 or "
            "later installed"
        )


def _check_shard_files(directory: str, index) -> None:
    sizes = {}
    for item in index.storage_data.values():
        path = os.path.join(directory, item.relative_path)
        if path not in sizes:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: shard file is missing")
            sizes[path] = os.path.getsize(path)
        if item.offset + item.length > sizes[path]:
            raise CheckpointError(
                f"{path}: truncated ({sizes[path]} bytes, the index needs "
                f"{item.offset + item.length})"
            )


def _model_tensor_problem(directory, saved, chunks):
    """(first problem or None, keys this rank's model expects) against the saved shapes."""
    expected = {}
    for chunk in chunks:
        sharded = chunk.sharded_state_dict()
        apply_factories(sharded)  # e.g. SwiGLU fc1 is saved as two tensors
        for value in nested_values(sharded):
            if isinstance(value, ShardedTensor):
                expected[value.key] = (tuple(value.global_shape), value.allow_shape_mismatch)
    for key, (shape, any_shape) in sorted(expected.items()):
        if key not in saved:
            return (
                f"{directory}: tensor {key!r} {list(shape)} is not in the checkpoint (a "
                "checkpoint of another model?)"
            ), set(expected)
        if saved[key] != shape and not any_shape:
            return (
                f"{directory}: tensor {key!r} has shape {list(saved[key])} in the checkpoint, "
                f"this model expects {list(shape)}"
            ), set(expected)
    return None, set(expected)
