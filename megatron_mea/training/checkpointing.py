"""`torch_dist` checkpoints of a whole run: model, optimizer, scheduler, data position, RNG.

Layout (Megatron-LM's): `<save>/iter_0000100/` per checkpoint and
`<save>/latest_checkpointed_iteration.txt` naming the newest complete one. A checkpoint is written
under `iter_XXXXXXX.tmp` and renamed only once every rank has finished, and the pointer file is
replaced atomically after that, so a crash mid-save leaves the previous checkpoint loadable.

Contents, as Megatron-LM's `torch_dist` checkpoints: the model (`model`, or `model0`, `model1`,
... per virtual pipeline stage), the optimizer's sharded state dict built with Megatron-LM's
metadata (`sharded_state_dict_metadata`, also stored as the checkpoint's content metadata), the
scheduler, the iteration, the consumed samples, the RNG state per (PP, TP) rank, and the
parallel layout it was saved at. Model and optimizer tensors are keyed by the parameters' global
keys, so a checkpoint resumes at any other TP / PP / VPP / EP / DP layout (`load_checkpoint`);
only the distributed optimizer's default `dp_reshardable` format is tied to its model-parallel
layout (refused with a message elsewhere).
"""

import logging
import os
import random
import re
import shutil

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    apply_factories,
)
from megatron.core.optimizer.optimizer import param_group_identifier_keys
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
    expects, with the same global shapes (another model's checkpoint). `model` is the model or
    its list of chunks (virtual pipeline stages).

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
             if hasattr(meta, "size") and not _OPTIMIZER_KEY.match(key)}
    problem, expected = _model_tensor_problem(directory, saved, _chunks(model))
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


# Optimizer tensors (checkpoints of earlier versions prefix a ChainedOptimizer's with chained_N.).
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")


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


def _chunks(model) -> list:
    """The model chunks of this rank (one, or one per virtual pipeline stage)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_keys(chunks) -> list:
    # Megatron-LM's names: "model", or "model0", "model1", ... with virtual pipeline stages.
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_state(chunks, metadata=None) -> dict:
    return {
        key: chunk.sharded_state_dict(metadata=metadata)
        for key, chunk in zip(_model_keys(chunks), chunks)
    }


def parallel_layout() -> dict:
    """Sizes that decide how the saved state maps onto this run's ranks."""
    return dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
    )


# Defaults for sizes that checkpoints of earlier versions did not record.
_LAYOUT_DEFAULTS = dict(vpp=1, etp=None, cp=1)
_LAYOUT_NAMES = dict(tp="TP", pp="PP", vpp="VPP", ep="EP", etp="ETP", cp="CP", dp="DP")


def _describe_layout(layout: dict) -> str:
    return " ".join(
        f"{_LAYOUT_NAMES[k]}={layout.get(k, _LAYOUT_DEFAULTS.get(k))}" for k in _LAYOUT_NAMES
        if layout.get(k, _LAYOUT_DEFAULTS.get(k)) is not None
    )


def layout_changes(saved: dict, current: dict) -> dict:
    """{size name: (saved, current)} for every size that differs (sizes a checkpoint did not
    record count as their defaults; an unknown saved size is not a change)."""
    changes = {}
    for key in _LAYOUT_NAMES:
        before = saved.get(key, _LAYOUT_DEFAULTS.get(key))
        if before is not None and before != current[key]:
            changes[key] = (before, current[key])
    return changes


def sharded_state_dict_metadata(
    use_distributed_optimizer=False, fully_reshardable=False, mem_efficient=False
) -> dict:
    """The `metadata` Megatron-LM passes to `model/optimizer.sharded_state_dict` (its
    `_build_sharded_state_dict_metadata`, torch_dist format): the distributed optimizer's
    sharding type (`dp_reshardable` by default, `fully_reshardable` on request), no singleton
    local shards, no per-optimizer key prefix in a ChainedOptimizer (so dense and expert state
    keep their keys when the chain differs between layouts), and the DP x CP group."""
    metadata = {}
    if use_distributed_optimizer:
        if fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = mem_efficient
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _serializable(metadata: dict) -> dict:
    return {key: value for key, value in metadata.items() if key != "dp_cp_group"}


# Sharding types of the distributed optimizer that Megatron can load at another TP/PP/EP layout
# (`DistributedOptimizer.checkpoint_fully_reshardable_formats`; `dp_reshardable` follows the
# optimizer's flat buffers, which exist per model-parallel rank).
FULLY_RESHARDABLE_TYPES = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def optimizer_reshard_problem(saved_metadata, changes: dict):
    """Why the saved optimizer state cannot be loaded at this layout (None if it can).

    The plain (non-distributed) optimizer saves one tensor per parameter and state kind, sharded
    like the parameter, so dist-ckpt reshards it to any TP/PP/EP/DP layout. The distributed
    optimizer's default `dp_reshardable` format follows its flat per-rank buffers (one per model
    chunk): Megatron can load it only where TP, PP, virtual stages, EP, expert TP and CP are
    unchanged (DP may change)."""
    sharding = (saved_metadata or {}).get("distrib_optim_sharding_type")
    if sharding is None or sharding in FULLY_RESHARDABLE_TYPES:
        return None
    model_parallel = {k: v for k, v in changes.items() if k != "dp"}
    if not model_parallel:
        return None
    what = ", ".join(f"{_LAYOUT_NAMES[k]} {a} -> {b}" for k, (a, b) in model_parallel.items())
    return (
        f"the distributed optimizer's state was saved as {sharding!r}, which Megatron can "
        f"reshard over data parallelism only, and this run changes {what}. Resume once at the "
        "saved layout with --dist-ckpt-optim-fully-reshardable and save again (that format "
        "loads at any layout), or pass --no-load-optim to start a fresh optimizer and "
        "learning-rate schedule from the loaded weights"
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


def save_checkpoint(
    root,
    iteration,
    model,
    optimizer,
    scheduler,
    consumed_samples,
    *,
    use_distributed_optimizer=False,
    fully_reshardable=False,
):
    """Save everything needed to resume exactly, at this or any other layout; all ranks call it.

    Args:
        root: the run's checkpoint directory (`--save`).
        iteration: completed optimizer steps.
        model: the unwrapped model, or its list of chunks (virtual pipeline stages).
        optimizer, scheduler: Megatron's optimizer and `OptimizerParamScheduler`.
        consumed_samples: global training samples consumed so far.
        use_distributed_optimizer, fully_reshardable: select the distributed optimizer's
            sharding type as Megatron-LM does (`dp_reshardable` unless `fully_reshardable`).
    """
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    metadata = sharded_state_dict_metadata(use_distributed_optimizer, fully_reshardable)
    state = _model_state(_chunks(model), metadata)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state.update(
        iteration=iteration,
        consumed_samples=consumed_samples,
        opt_param_scheduler=scheduler.state_dict(),
        parallel_layout=parallel_layout(),
        rng_state=_rng_sharded_object(_rng_state()),
    )
    dist_checkpointing.save(state, tmp, content_metadata=_serializable(metadata))
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


# ---- loading ---------------------------------------------------------------------------------

_FROM_CHECKPOINT = object()  # a leaf of the optimizer's state dict that dist-ckpt loads
# Param-group values the scheduler owns (set from its state after loading).
_SCHEDULER_OWNED = ("lr", "weight_decay", "max_lr", "min_lr", "start_wd", "end_wd")
# How Megatron tells param groups apart (its `param_group_identifier_keys` of 0.16; later
# releases add per-group overrides such as max_lr, which the driver does not set).
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# The scheduler's settings, the flags that set them, and Megatron's names in its log.
_SCHEDULE_SETTINGS = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "--lr-warmup-fraction x --train-iters"),
    ("lr_decay_steps", "--train-iters"),
    ("lr_decay_style", "--lr-decay-style"),
    ("start_wd", "--weight-decay"),
    ("end_wd", "--weight-decay"),
    ("wd_incr_steps", "--train-iters"),
    ("wd_incr_style", "(constant)"),
)


def _skeleton(tree):
    """The optimizer's sharded state dict with every loadable leaf replaced by a marker; the
    rest (param-group settings, the sharding type) are this run's own values."""
    if isinstance(tree, dict):
        return {key: _skeleton(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_skeleton(value) for value in tree]
    if isinstance(tree, (ShardedBase, LocalNonpersistentObject)):
        return _FROM_CHECKPOINT
    return tree


def _overlay(skeleton, loaded, path=()):
    """This rank's optimizer state dict: the skeleton's structure and values, with the loaded
    tensors (and the param ids of each group) at the marked leaves."""
    if skeleton is _FROM_CHECKPOINT:
        if loaded is None:
            raise CheckpointError(f"optimizer state {'.'.join(map(str, path))}: not loaded")
        return loaded
    if isinstance(skeleton, dict):
        return {
            key: _overlay(value, loaded.get(key) if isinstance(loaded, dict) else None,
                          path + (key,))
            for key, value in skeleton.items()
        }
    if isinstance(skeleton, list):
        # dist-ckpt returns lists of loaded leaves compacted (plain elements dropped): the
        # optimizer's lists hold either loadable leaves or dicts that contain one.
        items = loaded if isinstance(loaded, list) else []
        return [
            _overlay(value, items[i] if i < len(items) else None, path + (i,))
            for i, value in enumerate(skeleton)
        ]
    return skeleton


def _walk_dicts(tree):
    if isinstance(tree, dict):
        yield tree
        values = tree.values()
    elif isinstance(tree, (list, tuple)):
        values = tree
    else:
        return
    for value in values:
        yield from _walk_dicts(value)


def _param_groups(tree) -> list:
    return [
        group
        for node in _walk_dicts(tree)
        for group in (node.get("param_groups") if isinstance(node.get("param_groups"), list)
                      else [])
        if isinstance(group, dict)
    ]


def _identity(group) -> tuple:
    return tuple(group.get(key, group.get(f"pre_{key}")) for key in _GROUP_IDENTITY)


def _restore_saved_values(state_dict, saved) -> None:
    """Put the checkpoint's non-tensor optimizer state into this rank's state dict.

    The common (non-sharded) part of a checkpoint is written by rank 0 alone, in rank 0's
    structure, which another layout need not share (a pipeline stage without MoE layers has no
    expert optimizer; EP > 1 splits one). Taken from it, by meaning rather than position: Adam's
    step (`common_step`, or `step` in the distributed optimizer's groups) and the param groups'
    settings other than the scheduler's (betas, eps, ...), matched by group identity."""
    saved_groups = {_identity(group): group for group in _param_groups(saved)}
    group_step = next((g["step"] for g in saved_groups.values() if "step" in g), None)
    # Keys Megatron matches groups by must stay this run's (its load_state_dict matches them).
    fixed = {"params", "step", *_SCHEDULER_OWNED, *_GROUP_IDENTITY, *param_group_identifier_keys}
    changed = {}
    for group in _param_groups(state_dict):
        match = saved_groups.get(_identity(group))
        if match is not None:
            for key, value in match.items():
                if key in fixed:
                    continue
                if key in group and group[key] != value:
                    changed[key] = (value, group[key])
                group[key] = value
        if group_step is not None and "step" in group:
            group["step"] = group_step
    if changed and dist.get_rank() == 0:
        logger.warning(
            "optimizer settings from the checkpoint kept over this run's (as Megatron-LM): %s",
            ", ".join(f"{key} {saved!r} (not {ours!r})" for key, (saved, ours) in changed.items()),
        )
    common_step = next(
        (node["common_step"] for node in _walk_dicts(saved)
         if isinstance(node.get("common_step"), (int, float, torch.Tensor))),
        None,
    )
    if common_step is None:
        return
    for node in _walk_dicts(state_dict):  # torch optimizer state dicts: {state, param_groups}
        if isinstance(node.get("state"), dict) and "param_groups" in node:
            step = common_step.clone() if torch.is_tensor(common_step) else common_step
            node["state"]["common_step"] = step


def _require_saved_tensors(directory, index, request) -> None:
    """Raise on every rank (pooled verdicts) if a tensor this rank asks for is not saved."""
    saved = set(index.state_dict_metadata)
    missing = None
    for value in nested_values(request):
        if isinstance(value, ShardedObject):
            found = any(key.startswith(value.key + "/") or key == value.key for key in saved)
        elif isinstance(value, ShardedBase):
            found = value.key in saved
        else:
            continue
        if not found:
            missing = value.key
            break
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, missing)
    missing = next((m for m in verdicts if m), None)
    if missing:
        raise CheckpointError(
            f"{directory}: optimizer tensor {missing!r} is not in the checkpoint: it was saved "
            "with another optimizer (--use-distributed-optimizer, --bf16) or by an older "
            "version. Resume with the settings it was saved with, or pass --no-load-optim to "
            "start a fresh optimizer and learning-rate schedule from the loaded weights"
        )


def _state_kinds(request) -> list:
    """Optimizer state kinds in a sharded state dict (exp_avg, exp_avg_sq, fp32_param, ...)."""
    kinds = set()
    for value in nested_values(request):
        if isinstance(value, ShardedBase) and "optimizer.state." in value.key:
            kinds.add(value.key.split("optimizer.state.", 1)[1].split(".", 1)[0])
    return sorted(kinds)


def _check_schedule(directory, scheduler, saved: dict) -> None:
    """Megatron-LM's rule, with a message instead of an assert: unless told which to use
    (--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler), the schedule's
    settings must equal the checkpoint's."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    differences = [
        f"{name} {getattr(scheduler, name)!r} (from {flag}), checkpoint {saved[name]!r}"
        for name, flag in _SCHEDULE_SETTINGS
        if name in saved and getattr(scheduler, name) != saved[name]
    ]
    if differences:
        raise CheckpointError(
            f"{directory}: this run's learning-rate schedule differs from the checkpoint's: "
            + "; ".join(differences)
            + ". Pass --override-opt_param-scheduler to use this run's settings or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )


def _load_scheduler(scheduler, saved: dict) -> None:
    before = (scheduler.max_lr, scheduler.min_lr)
    scheduler.load_state_dict(saved)
    # Megatron's get_lr reads max_lr / min_lr from each param group; groups that follow the
    # run's settings follow the scheduler's (the checkpoint's, with --use-checkpoint-...).
    for group in scheduler.optimizer.param_groups:
        if group.get("max_lr") == before[0]:
            group["max_lr"] = scheduler.max_lr
        if group.get("min_lr") == before[1]:
            group["min_lr"] = scheduler.min_lr
    scheduler.step(increment=0)


def load_checkpoint(
    root, model, optimizer, scheduler, load_optim=True, load_rng=True,
    use_distributed_optimizer=False,
):
    """Restore the newest checkpoint under `root`; returns (iteration, consumed_samples).

    At any TP / PP (virtual stages included) / EP / DP layout: Megatron's dist-ckpt reshards the
    model and the optimizer state (Adam moments, fp32 main params where used, through
    `optimizer.sharded_state_dict`), and the scheduler and Adam's step are layout-free. The RNG
    state is per (PP, TP) rank: restored where those sizes match, otherwise the run keeps its
    fresh seed (as Megatron-LM). The data position is the global sample count, so any DP size
    continues with the same samples. What was resharded is logged on rank 0.

    `load_optim=False` (`--no-load-optim`) starts a fresh optimizer and scheduler from the
    loaded weights, as Megatron-LM does. A checkpoint without optimizer state (written by the
    converters) does the same.

    Raises:
        CheckpointError: a partial, corrupt or foreign checkpoint; optimizer state Megatron
            cannot reshard to this layout (the distributed optimizer's `dp_reshardable` format
            at another TP/PP/EP); a schedule that differs from the checkpoint's without
            --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no {TRACKER} in {root!r}: nothing to load")
    directory = checkpoint_dir(root, iteration)
    chunks = _chunks(model)
    verify_checkpoint(directory, chunks)
    common = dist_checkpointing.load_common_state_dict(directory)
    saved_metadata = common.get("content_metadata")  # None before this format
    saved_layout = common.get("parallel_layout") or {}
    model_only = "optimizer" not in common or "opt_param_scheduler" not in common
    layout = parallel_layout()
    changes = {} if model_only else layout_changes(saved_layout, layout)
    # Load with the metadata the checkpoint was saved with (Megatron-LM does the same).
    metadata = dict(saved_metadata or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if use_distributed_optimizer and "distrib_optim_sharding_type" not in metadata:
        metadata["distrib_optim_sharding_type"] = "fully_sharded_model_space"
    state = _model_state(chunks, metadata)

    load_optimizer = load_optim and not model_only
    if load_optimizer:
        problem = optimizer_reshard_problem(saved_metadata, changes)
        if problem:
            raise CheckpointError(f"{directory}: {problem}")
        _check_schedule(directory, scheduler, common["opt_param_scheduler"])
        request = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
        _require_saved_tensors(directory, FileSystemReader(directory).read_metadata(), request)
        skeleton, kinds = _skeleton(request), _state_kinds(request)
        # Under a key of its own: the common part saved under "optimizer" is rank 0's
        # structure, which dist-ckpt would otherwise merge into this rank's.
        state["optimizer_state"] = request
    rng_saved_at = (saved_layout.get("tp"), saved_layout.get("pp"))
    load_rng = load_rng and not model_only and rng_saved_at == (layout["tp"], layout["pp"])
    if load_rng:
        state["rng_state"] = _rng_sharded_object(_rng_state())

    loaded = dist_checkpointing.load(state, directory)
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key])
    if load_optimizer:
        optimizer_state = _overlay(skeleton, loaded["optimizer_state"])
        _restore_saved_values(optimizer_state, common["optimizer"])
        optimizer.load_state_dict(optimizer_state)
        _load_scheduler(scheduler, common["opt_param_scheduler"])
    else:
        # Fresh optimizer (Megatron-LM's --no-load-optim): its fp32 main params, where it has
        # them, must start from the loaded weights; the scheduler starts at step 0.
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    consumed = common["consumed_samples"]
    if dist.get_rank() == 0:
        # A fresh optimizer is worth a warning: the run does not continue as it was.
        logger.log(
            logging.INFO if load_optimizer else logging.WARNING,
            "%s", _resume_summary(directory, iteration, consumed, saved_layout, layout, changes,
                                  model_only, kinds if load_optimizer else None, load_rng),
        )
    return iteration, consumed


def _resume_summary(directory, iteration, consumed, saved_layout, layout, changes, model_only,
                    kinds, rng_loaded) -> str:
    lines = [f"loaded checkpoint {directory} (iteration {iteration})"]
    if model_only:
        lines.append("a model-only checkpoint (no optimizer state): loading the model only "
                     f"(resharded by dist-ckpt to {_describe_layout(layout)}); fresh optimizer "
                     "and learning-rate schedule")
    else:
        lines.append(f"layout: saved at {_describe_layout(saved_layout)}, this run "
                     f"{_describe_layout(layout)}")
        verb = "resharded by dist-ckpt" if changes else "loaded at the same layout"
        if kinds is not None:
            lines.append(f"{verb}: model, optimizer state ({', '.join(kinds)}; Adam step and "
                         "param-group settings); scheduler state restored")
        else:
            lines.append(f"{verb}: model; optimizer and learning-rate schedule start fresh "
                         "(--no-load-optim)")
        if rng_loaded:
            lines.append("RNG state restored")
        elif changes.keys() & {"tp", "pp"}:
            lines.append("RNG state not restored: it is saved per (PP, TP) rank and those sizes "
                         "changed; the run keeps its seed")
        else:
            lines.append("RNG state not restored (--no-load-rng)")
    lines.append(f"data: continues at global sample {consumed} (same order at any DP size)")
    return "; ".join(lines)
