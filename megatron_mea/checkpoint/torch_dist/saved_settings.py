"""What a checkpoint records of the run that wrote it, and the refusals of a resume that differs.

A training checkpoint records its run's data settings (`data_settings`: vocabulary, tokenizer,
sequence length, and every setting of the run but the invocation's); a resume with other data
settings is refused (`check_data_settings`), one with other run settings names them
(`setting_changes`). A tensor mismatch is restated as the model settings that differ, read from
the saving run's `config.yaml` (`explain_model_mismatch`). Every message is one line naming the
setting and its flag.
"""

import dataclasses
import logging
import os
from typing import Optional

from megatron_mea.checkpoint.errors import CheckpointError, ModelMismatchError
from megatron_mea.model.args import TENSOR_FIELDS

logger = logging.getLogger(__name__)

# Run fields that decide the model's tensors and their shapes, besides the attention
# variant's fields of scope "model": declared with the model description.
MODEL_SETTINGS = TENSOR_FIELDS


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
