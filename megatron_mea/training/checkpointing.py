"""`torch_dist` checkpoints of a whole run: model, optimizer, scheduler, data position, RNG.

Layout (Megatron-LM's): `<save>/iter_0000100/` per checkpoint and
`<save>/latest_checkpointed_iteration.txt` naming the newest complete one. A checkpoint is written
under `iter_XXXXXXX.tmp` and renamed only once every rank has finished, and the pointer file is
replaced atomically after that, so a crash mid-save leaves the previous checkpoint loadable.
"""

import logging
import os
import random
import shutil

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from torch.distributed.checkpoint import FileSystemReader

from megatron_mea.compat import COMMON_STATE_FILE, COMMON_STATE_KEY

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: the message names the file or tensor."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """Directory of the checkpoint of `iteration` under `root`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str):
    """The iteration named by the tracker file, or None if there is no complete checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def verify_checkpoint(directory: str, model) -> None:
    """Refuse a partial, corrupt or foreign checkpoint before any collective load starts.

    Every rank runs the same checks on the same files, so all of them raise together instead of
    some waiting forever in a collective. Checks: the directory, Megatron's `metadata.json` and
    the common state exist (a `common.pt` file up to Megatron-Core 0.16, a `common_state`
    object in the index from 0.17); every byte range the torch_dist index points at lies inside an existing
    shard file (missing or truncated shards); the model tensors are exactly the ones this model
    expects, with the same global shapes (another model's checkpoint).

    Raises:
        CheckpointError: naming the file or tensor and the problem.
    """
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint directory is missing")
    for name in ("metadata.json", ".metadata"):
        if not os.path.exists(os.path.join(directory, name)):
            raise CheckpointError(f"{os.path.join(directory, name)}: missing (partial checkpoint)")
    try:
        index = FileSystemReader(directory).read_metadata()
    except Exception as exc:  # unreadable index: report it as such, whatever torch raised
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: unreadable ({exc})") from exc
    common_file = os.path.join(directory, COMMON_STATE_FILE)
    if not os.path.exists(common_file) and not any(
        key.startswith(COMMON_STATE_KEY) for key in index.state_dict_metadata
    ):
        raise CheckpointError(
            f"{common_file}: missing, and no {COMMON_STATE_KEY!r} object in the index either "
            "(partial checkpoint)"
        )
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
    saved = {key: tuple(meta.size) for key, meta in index.state_dict_metadata.items()
             if hasattr(meta, "size") and not key.startswith("optimizer.")}
    problem, expected = _model_tensor_problem(directory, saved, model)
    # Each pipeline stage expects only its own layers: pool the verdicts and the expected keys,
    # so that every rank raises the same error (a rank raising alone would leave the others
    # waiting in the next collective).
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (problem, expected))
    problems = [p for p, _ in verdicts if p]
    if problems:
        raise CheckpointError(problems[0])
    extra = sorted(set(saved) - set().union(*(keys for _, keys in verdicts)))
    if extra:
        raise CheckpointError(
            f"{directory}: {len(extra)} tensors of the checkpoint are not in this model, e.g. "
            f"{extra[0]!r} (a checkpoint of another model?)"
        )


def _model_tensor_problem(directory, saved, model):
    """(first problem or None, keys this rank's model expects) against the saved shapes."""
    sharded = model.sharded_state_dict()
    apply_factories(sharded)  # e.g. SwiGLU fc1 is saved as two tensors
    expected = {}
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


def parallel_layout() -> dict:
    """Sizes that decide whether optimizer and RNG states can be restored as saved."""
    return dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
    )


def _rng_state() -> dict:
    state = dict(
        random=random.getstate(),
        numpy=numpy.random.get_state(),
        torch=torch.get_rng_state(),
        tracker=tensor_parallel.get_cuda_rng_tracker().get_states(),
    )
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state) -> ShardedObject:
    # One entry per (pp, tp) rank; data-parallel replicas hold copies (replica_id = dp rank).
    pp, tp = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    shape = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    return ShardedObject(
        "rng_state", state, shape, (pp, tp), replica_id=parallel_state.get_data_parallel_rank()
    )


def save_checkpoint(root, iteration, model, optimizer, scheduler, consumed_samples):
    """Save everything needed to resume exactly; all ranks call it.

    Args:
        root: the run's checkpoint directory (`--save`).
        iteration: completed optimizer steps.
        model: the unwrapped model (has `sharded_state_dict`).
        optimizer, scheduler: Megatron's optimizer and `OptimizerParamScheduler`.
        consumed_samples: global training samples consumed so far.
    """
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state.update(
        iteration=iteration,
        consumed_samples=consumed_samples,
        opt_param_scheduler=scheduler.state_dict(),
        parallel_layout=parallel_layout(),
        rng_state=_rng_sharded_object(_rng_state()),
    )
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):  # re-saving an iteration: keep the old one until replaced
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        pointer = os.path.join(root, TRACKER)
        with open(pointer + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(str(iteration))
        os.replace(pointer + ".tmp", pointer)
    dist.barrier()
    logger.info("saved checkpoint %s", final)


def load_checkpoint(root, model, optimizer, scheduler, load_optim=True, load_rng=True):
    """Restore the newest checkpoint under `root`; returns (iteration, consumed_samples).

    The model loads at any TP/PP/EP layout (Megatron reshards it). Optimizer and RNG states are
    restored only when the layout is the one they were saved at; otherwise they are skipped with
    a warning and training continues from the loaded weights.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no {TRACKER} in {root!r}: nothing to load")
    directory = checkpoint_dir(root, iteration)
    verify_checkpoint(directory, model)
    state = {"model": model.sharded_state_dict()}
    common = dist_checkpointing.load_common_state_dict(directory)
    same_layout = common.get("parallel_layout") == parallel_layout()
    if not same_layout:
        logger.warning(
            "checkpoint %s was saved at %s, this run is %s: loading the model only (optimizer and "
            "RNG states are per layout)", directory, common.get("parallel_layout"),
            parallel_layout(),
        )
    if load_optim and same_layout:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True)
    if load_rng and same_layout:
        state["rng_state"] = _rng_sharded_object(_rng_state())
    loaded = dist_checkpointing.load(state, directory)
    model.load_state_dict(loaded["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        # Fresh optimizer: continue the learning-rate schedule from the saved step.
        scheduler.step(increment=common["iteration"])
    if "rng_state" in state:
        _set_rng_state(loaded["rng_state"])
    logger.info("loaded checkpoint %s (iteration %d)", directory, iteration)
    return iteration, common["consumed_samples"]
