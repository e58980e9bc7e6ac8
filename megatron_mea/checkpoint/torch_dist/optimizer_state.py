"""Restoring the optimizer and the learning-rate scheduler from a loaded checkpoint.

dist-ckpt loads the optimizer's tensors into a sharded state dict built for this run's layout;
what it cannot reshard (the non-tensor state rank 0 saved in its own structure: Adam's step,
param-group settings) is put back by meaning here, and the scheduler follows Megatron-LM's rules.
"""

import logging

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
)
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from megatron_mea.checkpoint.errors import CheckpointError

# Messages of the checkpointing module's logger: one place to follow a resume.
logger = logging.getLogger("megatron_mea.checkpoint.torch_dist.training_state")

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
    ("lr_warmup_steps", "--lr-warmup-iters, or --lr-warmup-fraction x --train-iters"),
    ("lr_decay_steps", "--train-iters"),
    ("lr_decay_style", "--lr-decay-style"),
    ("start_wd", "--weight-decay"),
    ("end_wd", "--weight-decay"),
    ("wd_incr_steps", "--train-iters"),
    ("wd_incr_style", "(constant)"),
)


def skeleton(tree):
    """The optimizer's sharded state dict with every loadable leaf replaced by a marker; the
    rest (param-group settings, the sharding type) are this run's own values."""
    if isinstance(tree, dict):
        return {key: skeleton(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [skeleton(value) for value in tree]
    if isinstance(tree, (ShardedBase, LocalNonpersistentObject)):
        return _FROM_CHECKPOINT
    return tree


def overlay(skeleton, loaded, path=()):
    """This rank's optimizer state dict: the skeleton's structure and values, with the loaded
    tensors (and the param ids of each group) at the marked leaves."""
    if skeleton is _FROM_CHECKPOINT:
        if loaded is None:
            raise CheckpointError(f"optimizer state {'.'.join(map(str, path))}: not loaded")
        return loaded
    if isinstance(skeleton, dict):
        return {
            key: overlay(value, loaded.get(key) if isinstance(loaded, dict) else None,
                          path + (key,))
            for key, value in skeleton.items()
        }
    if isinstance(skeleton, list):
        # dist-ckpt returns lists of loaded leaves compacted (plain elements dropped): the
        # optimizer's lists hold either loadable leaves or dicts that contain one.
        items = loaded if isinstance(loaded, list) else []
        return [
            overlay(value, items[i] if i < len(items) else None, path + (i,))
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


def restore_saved_values(state_dict, saved) -> None:
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


def require_saved_tensors(directory, index, request) -> None:
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


def state_kinds(request) -> list:
    """Optimizer state kinds in a sharded state dict (exp_avg, exp_avg_sq, fp32_param, ...)."""
    kinds = set()
    for value in nested_values(request):
        if isinstance(value, ShardedBase) and "optimizer.state." in value.key:
            kinds.add(value.key.split("optimizer.state.", 1)[1].split(".", 1)[0])
    return sorted(kinds)


def check_schedule(directory, scheduler, saved: dict, batch_sizes=(None, None)) -> None:
    """Megatron-LM's rule, with a message instead of an assert: unless told which to use
    (--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler), the schedule's
    settings must equal the checkpoint's.

    `batch_sizes` (the checkpoint's global batch size, this run's) are held to the same rule:
    Megatron-LM counts its schedule in samples, so its scheduler check refuses a changed
    `--global-batch-size`; this schedule counts iterations, which would let the change pass
    unseen. Told to go on, the change is stated in a warning, as Megatron-LM logs its override.
    """
    (saved_batch, batch), told = batch_sizes, (scheduler.override_opt_param_scheduler
                                               or scheduler.use_checkpoint_opt_param_scheduler)
    batch_changed = saved_batch is not None and batch != saved_batch
    if told:
        if batch_changed:
            flag = ("--override-opt_param-scheduler" if scheduler.override_opt_param_scheduler
                    else "--use-checkpoint-opt_param-scheduler")
            logger.warning("%s: the global batch size changes from the checkpoint's %s to %s "
                           "(--global-batch-size, accepted with %s): each step from here reads "
                           "%s samples", directory, saved_batch, batch, flag, batch)
        return
    differences = [
        f"{name} {getattr(scheduler, name)!r} (from {flag}), checkpoint {saved[name]!r}"
        for name, flag in _SCHEDULE_SETTINGS
        if name in saved and getattr(scheduler, name) != saved[name]
    ]
    if batch_changed:
        differences.append(f"global_batch_size {batch} (from --global-batch-size), checkpoint "
                           f"{saved_batch}")
    if differences:
        raise CheckpointError(
            f"{directory}: this run's learning-rate schedule differs from the checkpoint's: "
            + "; ".join(differences)
            + ". Pass --override-opt_param-scheduler to use this run's settings or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )


def load_scheduler(scheduler, saved: dict) -> None:
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
