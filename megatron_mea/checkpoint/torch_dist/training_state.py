"""`torch_dist` checkpoints of a whole run: model, optimizer, scheduler, data position, RNG.

Layout (Megatron-LM's): `<save>/iter_0000100/` per checkpoint and
`<save>/latest_checkpointed_iteration.txt` naming the newest complete one. A checkpoint is written
under `iter_XXXXXXX.tmp` and renamed only once every rank has finished, and the pointer file is
replaced atomically after that, so a crash mid-save leaves the previous checkpoint loadable.
Each checkpoint lists its files with their sizes and CRC-32 (`checksums.json`), checked on load.

Contents, as Megatron-LM's `torch_dist` checkpoints: the model (`model`, or `model0`, `model1`,
... per virtual pipeline stage), the optimizer's sharded state dict built with Megatron-LM's
metadata (`sharded_state_dict_metadata`, also stored as the checkpoint's content metadata), the
scheduler, the iteration, the consumed samples, the RNG state per (PP, TP) rank, and the
parallel layout it was saved at. Model and optimizer tensors are keyed by the parameters' global
keys, so a checkpoint resumes at any other TP / PP / VPP / EP / DP layout (`load_checkpoint`);
only the distributed optimizer's default `dp_reshardable` format is tied to its model-parallel
layout (refused with a message).

`mea-pretrain` saves and resumes with it (`megatron_mea.apps.training.loop`). The directory
layout is `layout`'s, the checks that refuse a checkpoint before loading `checks`'
(`verify_checkpoint`), those that refuse a resume with other settings `saved_settings`', the
restoring of optimizer and scheduler state `optimizer_state`'s.
"""

import argparse
import logging
import os
import random
import shutil

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mea.checkpoint.errors import CheckpointError
from megatron_mea.checkpoint.megatron_lm.writing import CHECKPOINT_VERSION
from megatron_mea.checkpoint.torch_dist import integrity, optimizer_state
from megatron_mea.checkpoint.torch_dist.checks import chunks_of, verify_checkpoint
from megatron_mea.checkpoint.torch_dist.layout import (
    TRACKER,
    checkpoint_dir,
    latest_iteration,
    write_tracker,
)
from megatron_mea.checkpoint.torch_dist.saved_settings import check_data_settings, setting_changes
from megatron_mea.checkpoint.torch_dist.save_failures import (
    SaveFailed,
    describe_failure,
    is_write_error,
    no_space_left,
)

__all__ = [
    "SaveFailed",
    "layout_changes",
    "load_checkpoint",
    "optimizer_reshard_problem",
    "parallel_layout",
    "save_checkpoint",
    "sharded_state_dict_metadata",
]

logger = logging.getLogger(__name__)


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
    data_settings=None,
    megatron_lm_args=None,
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
        data_settings: the run's vocabulary, tokenizer and sequence length
            (`megatron_mea.checkpoint.torch_dist.saved_settings.data_settings`), compared on
            resume.
        megatron_lm_args: the run's arguments as Megatron-LM saves them
            (`checkpoint.megatron_lm.writing.megatron_lm_arguments`, built once per run), saved
            with `consumed_samples` and the checkpoint version so that Megatron-LM's
            `pretrain_gpt.py --use-checkpoint-args` continues.

    Raises:
        SaveFailed: on every rank, where a rank could not write its part (the partial
            `iter_XXXXXXX.tmp` removed; the previous checkpoint stays `latest`).
    """
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    rank = dist.get_rank()
    # Each stage ends with `_agree` (a barrier that shares failure), so a stage that fails on
    # one rank stops every rank at the same point, and the `.tmp` never outlives the failure.
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            # A full disk refused here, on every rank at once: rank 0's first write inside the
            # writer (`common.pt`) would fail while the other ranks wait in its collectives.
            error = no_space_left(root)
        except OSError as exc:
            error = describe_failure(exc, root)
    _agree(error, final, tmp)
    metadata = sharded_state_dict_metadata(use_distributed_optimizer, fully_reshardable)
    state = _model_state(chunks_of(model), metadata)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state.update(
        iteration=iteration,
        consumed_samples=consumed_samples,
        opt_param_scheduler=scheduler.state_dict(),
        parallel_layout=parallel_layout(),
        rng_state=_rng_sharded_object(_rng_state()),
    )
    if data_settings is not None:
        state["data_settings"] = data_settings
    if megatron_lm_args is not None:
        # Megatron-LM continues its data at the checkpoint's position, read from its arguments.
        saved_args = argparse.Namespace(
            **{**vars(megatron_lm_args), "consumed_train_samples": consumed_samples}
        )
        state.update(args=saved_args, checkpoint_version=CHECKPOINT_VERSION)
    try:
        dist_checkpointing.save(state, tmp, content_metadata=_serializable(metadata))
    except (OSError, RuntimeError, CheckpointException) as exc:  # gathered on all ranks
        if not is_write_error(exc):  # e.g. a collective that timed out: not the disk's fault
            raise
        error = describe_failure(exc, root)
    _agree(error, final, tmp)
    try:
        _write_checksums(tmp)
    except OSError as exc:
        error = describe_failure(exc, root)
    _agree(error, final, tmp)
    if rank == 0:
        try:
            _publish(root, final, tmp, iteration)
        except OSError as exc:
            error = describe_failure(exc, root)
    _agree(error, final, tmp)
    logger.info("saved checkpoint %s", final)


def _publish(root: str, final: str, tmp: str, iteration: int) -> None:
    """Rank 0: rename the finished `tmp` to `final`, then point the tracker at it (where that
    fails, `final` goes back to `tmp`, to be removed: a checkpoint `latest` does not name would
    look like a later run's)."""
    if os.path.exists(final):  # re-saving an iteration: keep the old one until replaced
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    try:
        write_tracker(root, iteration)
    except OSError:
        os.rename(final, tmp)
        raise


def _agree(error, final: str, tmp: str) -> None:
    """A barrier that shares failure: raise SaveFailed on every rank when a rank's `error` is
    set (the cause on that rank, its number on the others), after rank 0 removed `tmp`."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    failed = torch.tensor([0 if error is None else dist.get_rank() + 1], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    culprit = int(failed.item()) - 1
    if culprit < 0:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save only takes space
    cause = error or f"rank {culprit} failed (its own line says why)"
    raise SaveFailed(f"saving checkpoint {final} failed: {cause}; "
                     f"its partial {os.path.basename(tmp)} was removed")


def _write_checksums(directory: str) -> None:
    """Rank 0 writes `checksums.json` of every file of the save; each rank hashes its share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = integrity.checksum_files(directory, integrity.checkpoint_files(directory)[rank::world])
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        integrity.write_checksums(directory, {k: v for share in shares for k, v in share.items()})


def load_checkpoint(
    root, model, optimizer, scheduler, load_optim=True, load_rng=True,
    use_distributed_optimizer=False, iteration=None, data_settings=None,
    override_data_settings=False,
):
    """Restore the newest checkpoint under `root` (or that of `iteration`, `--ckpt-step`);
    returns (iteration, consumed_samples).

    At any TP / PP (virtual stages included) / EP / DP layout: Megatron's dist-ckpt reshards the
    model and the optimizer state (Adam moments, fp32 main params where used, through
    `optimizer.sharded_state_dict`), and the scheduler and Adam's step are layout-free. The RNG
    state is per (PP, TP) rank: restored where those sizes match, otherwise the run keeps its
    fresh seed (as Megatron-LM). The data position is the global sample count, so any DP size
    continues with the same samples. What was resharded is logged on rank 0.

    `data_settings` (this run's vocabulary, tokenizer, sequence length) must equal the
    checkpoint's unless `override_data_settings`.

    `load_optim=False` (`--no-load-optim`) starts a fresh optimizer and scheduler from the
    loaded weights, as Megatron-LM does. A checkpoint without optimizer state (written by the
    converters) does the same.

    Raises:
        CheckpointError: a partial, corrupt or foreign checkpoint (`ModelMismatchError` for
            another model's tensors), or one in a newer Megatron-Core's layout; optimizer state
            Megatron cannot reshard to this layout (the distributed optimizer's `dp_reshardable`
            format at another TP/PP/EP); a schedule that differs from the checkpoint's without
            --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler.
    """
    if iteration is None:
        iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no {TRACKER} in {root!r}: nothing to load")
    directory = checkpoint_dir(root, iteration)
    chunks = chunks_of(model)
    verify_checkpoint(directory, chunks)
    common = dist_checkpointing.load_common_state_dict(directory)
    if data_settings is not None:
        check_data_settings(directory, common.get("data_settings"), data_settings,
                            override_data_settings)
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
        saved_run = (common.get("data_settings") or {}).get("run") or {}
        optimizer_state.check_schedule(
            directory, scheduler, common["opt_param_scheduler"],
            batch_sizes=(saved_run.get("global_batch_size"),
                         ((data_settings or {}).get("run") or {}).get("global_batch_size")))
        request = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
        optimizer_state.require_saved_tensors(
            directory, integrity.read_index(directory), request
        )
        skeleton, kinds = optimizer_state.skeleton(request), optimizer_state.state_kinds(request)
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
        restored = optimizer_state.overlay(skeleton, loaded["optimizer_state"])
        optimizer_state.restore_saved_values(restored, common["optimizer"])
        optimizer.load_state_dict(restored)
        optimizer_state.load_scheduler(scheduler, common["opt_param_scheduler"])
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
                                  model_only, kinds if load_optimizer else None, load_rng,
                                  setting_changes(common.get("data_settings"),
                                                  data_settings or {})),
        )
    return iteration, consumed


def _resume_summary(directory, iteration, consumed, saved_layout, layout, changes, model_only,
                    kinds, rng_loaded, settings_changed) -> str:
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
    lines.append("settings changed since the checkpoint: " + (", ".join(settings_changed)
                                                              or "none"))
    return "; ".join(lines)
