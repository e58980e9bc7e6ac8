"""Finding a checkpoint and refusing one that cannot be loaded, before any collective load starts.

`verify_checkpoint` checks the files (partial, truncated, written by a newer Megatron-Core) and
the model tensors against the model (another model's checkpoint); `explain_model_mismatch`
turns a tensor mismatch into the model settings that differ, read from the run's saved
`config.yaml`. Every message is one line naming the file, the tensor or the setting.
"""

import dataclasses
import json
import logging
import os
import re

from typing import Optional, Tuple

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from megatron_mea import compat
from megatron_mea.checkpoint.torch_dist import integrity
from megatron_mea.checkpoint.torch_dist.safe_pickle import UnsafePickleError
from megatron_mea.model.args import TENSOR_FIELDS

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter_(\d{7})$")

# Optimizer tensors (checkpoints of earlier versions prefix a ChainedOptimizer's with chained_N.).
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")

# Run fields that decide the model's tensors and their shapes, besides the attention
# variant's fields of scope "model": declared with the model description.
MODEL_SETTINGS = TENSOR_FIELDS


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: the message names the file or tensor."""


class ModelMismatchError(CheckpointError):
    """The checkpoint's model tensors are not this model's (other names or shapes)."""


class ConversionError(ValueError):
    """A checkpoint or model that cannot be converted as asked; the message names the tensor."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """Directory of the checkpoint of `iteration` under `root`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iterations(root: str) -> list:
    """The iterations of the `iter_XXXXXXX` directories under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(ITER_DIR.match, os.listdir(root)) if m)


def missing_checkpoint(directory: str) -> str:
    """The one line for an `iter_XXXXXXX` directory that does not exist: that its run directory
    does not exist either, or which iterations are saved there."""
    root = os.path.dirname(directory)
    if not os.path.isdir(root):
        return f"{root}: no such directory"
    found = saved_iterations(root)
    saved = ", ".join(map(str, found)) if found else "none"
    return f"{directory}: no such checkpoint (iterations saved there: {saved})"


def split_checkpoint_path(path: str, iteration: Optional[int] = None
                          ) -> Tuple[str, Optional[int]]:
    """(run directory, iteration) of a `--load` that names a run directory or one of its
    `iter_XXXXXXX` folders, so every tool accepts both (`--load DIR --ckpt-step N` is
    `--load DIR/iter_000000N`).

    Raises:
        CheckpointError: `iteration` contradicts the folder's number.
    """
    path = os.path.normpath(path)
    match = ITER_DIR.match(os.path.basename(path))
    if not match:
        return path, iteration
    found = int(match.group(1))
    if iteration is not None and iteration != found:
        raise CheckpointError(f"--ckpt-step {iteration} contradicts the checkpoint path {path}")
    return os.path.dirname(path), found


def latest_iteration(root: str):
    """The iteration named by the tracker file, or None if there is no complete checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as handle:
        raw = handle.read(64)
    text = raw.decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise CheckpointError(f"{path}: expected an iteration number, found {raw[:20]!r}")
    return int(text)


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


def model_setting_differences(saved: dict, current: dict) -> list:
    """`name X in the checkpoint, Y in this run (--flag)` for each setting that differs.

    Args:
        saved: the checkpoint's model settings (see `model_settings`).
        current: this run's, the same keys.
    """
    return [
        f"{name} {saved[name]!r} in the checkpoint, {current[name]!r} in this run "
        f"(--{name.replace('_', '-')})"
        for name in saved
        if name in current and saved[name] != current[name]
    ]


def explain_model_mismatch(root: str, args, error: ModelMismatchError) -> CheckpointError:
    """`error` restated as the model settings that differ between the run that saved `root`
    (its `config.yaml`) and `args` (a `RunArgs`), or `error` itself when there is no
    config.yaml or no setting differs (the tensor message is then the best there is)."""
    from megatron_mea.model.run_config import load_run_args

    path = os.path.join(root, "config.yaml")
    if not os.path.isfile(path):
        return error
    try:
        saved_args = load_run_args(path)
    except (TypeError, ValueError):  # a config of another version: keep the tensor message
        return error
    differences = model_setting_differences(model_settings(saved_args), model_settings(args))
    if not differences:
        return error
    return CheckpointError(
        f"{root}: the checkpoint's model differs from this run's: {'; '.join(differences)}. "
        "Pass the checkpoint's settings (see its config.yaml) to resume it"
    )


def model_settings(args) -> dict:
    """The settings of `args` (a `RunArgs`) that decide the model's tensors and shapes.

    The padded vocabulary is not one of them: Megatron loads the embedding and output layer
    across a change of padding (their `allow_shape_mismatch`)."""
    from megatron_mea.variant import variant_settings

    # variant_settings gives tuples for list-valued fields (YAML gives lists, code may use tuples).
    return {**{name: getattr(args, name) for name in MODEL_SETTINGS},
            **variant_settings(args, scopes=("model",))}


# Settings of the data a run was trained on: resuming with another vocabulary, tokenizer or
# sequence length would go on silently (Megatron resizes the embedding) with another meaning.
DATA_SETTINGS = {"vocab_size": "--vocab-size", "tokenizer_type": "--tokenizer-type",
                 "tokenizer": "--tokenizer-model", "seq_length": "--seq-length"}


# Flags of one invocation rather than of the run: a resume differs in them by design.
INVOCATION_SETTINGS = frozenset({
    "save", "load", "ckpt_step", "rewind_save", "overwrite_save", "no_load_optim", "no_load_rng",
    "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
    "override_checkpoint_data_settings", "exit_on_missing_checkpoint", "no_progress_bar",
})


def data_settings(args) -> dict:
    """The settings of `args` (a `RunArgs`, vocab_size resolved) a checkpoint records: those of
    `DATA_SETTINGS`, the tokenizer by its directory's name (a run may move, the tokenizer stays
    the same), and under "run" every setting of the run but `INVOCATION_SETTINGS`, which a
    resume names where they changed (`setting_changes`)."""
    model = args.tokenizer_model
    run = {name: list(value) if isinstance(value, tuple) else value
           for name, value in dataclasses.asdict(args).items()
           if name not in INVOCATION_SETTINGS}
    return dict(vocab_size=args.vocab_size, tokenizer_type=args.tokenizer_type,
                tokenizer=os.path.basename(os.path.normpath(model)) if model else None,
                seq_length=args.seq_length, run=run)


def setting_changes(saved: Optional[dict], current: dict) -> list:
    """"--global-batch-size 8 -> 16" for each setting of `current["run"]` whose value in the
    checkpoint's `saved` settings differs ([] for a checkpoint that has none recorded)."""
    before, now = (saved or {}).get("run") or {}, current.get("run") or {}
    return [f"--{name.replace('_', '-')} {before[name]} -> {now[name]}"
            for name in now if name in before and before[name] != now[name]]


def check_data_settings(directory: str, saved, current: dict, override: bool) -> None:
    """Refuse a resume whose data settings differ from the checkpoint's (unless `override`,
    `--override-checkpoint-data-settings`, then a warning). A checkpoint without them (a
    converter's, or an earlier version's) is not checked."""
    if not saved:
        return
    changes = [f"{name} {saved[name]!r} in the checkpoint, {current[name]!r} in this run "
               f"({flag})" for name, flag in DATA_SETTINGS.items()
               if name in saved and saved[name] != current[name]]
    if not changes:
        return
    if override:
        logger.warning("%s: resuming with other data settings (--override-checkpoint-data-"
                       "settings): %s", directory, "; ".join(changes))
        return
    raise CheckpointError(
        f"{directory}: {'; '.join(changes)}; pass the checkpoint's settings, or "
        "--override-checkpoint-data-settings to change them on purpose"
    )
