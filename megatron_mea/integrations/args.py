"""Command-line flags for the plugin's config fields, generated from their one declaration.

Every field of `megatron_mea.variant.AttentionVariantFields` (the fields `MEATransformerConfig`
adds to Megatron's `TransformerConfig`) becomes one flag whose argparse `dest` is the field
name, so Megatron-LM's `core_transformer_config_from_args(args, MEATransformerConfig)` (which
copies every `args.<name>` matching a dataclass field) fills the config with no glue. Nothing here imports `megatron.training`.
"""

import argparse
import dataclasses
import typing
from typing import Literal, Optional

from megatron_mea.variant import AttentionVariantFields, field_help, fields_of_scope

# Fields that choose how the model runs rather than what it computes: a resumed run may change them,
# so they are not taken from the checkpoint under --use-checkpoint-args.
RUNTIME_FIELDS = fields_of_scope("training")


def plugin_fields() -> list:
    """The dataclass fields the plugin adds to `TransformerConfig`, in declaration order."""
    return list(dataclasses.fields(AttentionVariantFields))


def flag_name(field_name: str) -> str:
    """`attention_variant` -> `--attention-variant` (Megatron-LM's naming rule)."""
    return "--" + field_name.replace("_", "-")


class _StoreTuple(argparse.Action):
    """nargs='+' that stores a tuple, the type the config's tuple fields hold."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(values))


def _argparse_kwargs(name: str, annotation, default) -> dict:
    """add_argument() keywords for one field; TypeError for an annotation argparse cannot express."""
    origin, inner = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union and len(inner) == 2 and type(None) in inner:
        return _argparse_kwargs(name, next(t for t in inner if t is not type(None)), default)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"type": type(inner[0]), "choices": inner}
    if annotation is tuple or origin is tuple:
        element = inner[0] if inner else str
        if typing.get_origin(element) is Literal:
            return {"type": str, "nargs": "+", "action": _StoreTuple,
                    "choices": typing.get_args(element)}
        return {"type": element, "nargs": "+", "action": _StoreTuple}
    if annotation in (int, float, str):
        return {"type": annotation}
    raise TypeError(f"cannot make a command-line flag for field {name!r} of type {annotation}")


def add_mea_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per `MEATransformerConfig` plugin field; usable as an `extra_args_provider`.

    Flags are `--attention-variant`, `--mea-num-kv-components`, ... with `dest` equal to the field
    name, the field's default, `choices` from its `Literal` annotation, a tuple (nargs='+') for
    tuple fields and `--x/--no-x` for booleans. Help text is the field's docstring.

    Args:
        parser: the parser to extend (Megatron-LM's, or any argparse parser).

    Returns:
        The same parser, as Megatron-LM's `extra_args_provider` contract requires.
    """
    hints = typing.get_type_hints(AttentionVariantFields)
    group = parser.add_argument_group(
        title="megatron_mea", description="MEA / KHA attention variants (megatron_mea plugin)"
    )
    for field in plugin_fields():
        kwargs = _argparse_kwargs(field.name, hints[field.name], field.default)
        help_text = field_help(field.name)
        group.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=field.default,
            help=help_text.replace("%", "%%"),
            **kwargs,
        )
    return parser


def mea_config_kwargs(args: argparse.Namespace) -> dict:
    """The plugin fields of `args` as `MEATransformerConfig` keyword arguments."""
    return {f.name: getattr(args, f.name) for f in plugin_fields() if hasattr(args, f.name)}


def restore_mea_args(
    args: argparse.Namespace, checkpoint_args: Optional[argparse.Namespace]
) -> list:
    """Copy the plugin's model-defining fields from a checkpoint's saved args into `args`.

    Megatron-LM's `load_args_from_checkpoint` restores only a fixed list of its own flags, so a run
    resumed with `--use-checkpoint-args` would otherwise fall back to the plugin defaults (a
    standard-attention model that cannot load an MEA checkpoint). Checkpoint values win, as they
    do for `num_query_groups`. Fields absent from the checkpoint (a baseline checkpoint being
    upcycled) and `RUNTIME_FIELDS` keep their command-line value.

    Args:
        args: the parsed arguments, updated in place.
        checkpoint_args: the `args` namespace stored in the checkpoint (None: nothing to do).

    Returns:
        `(name, old, new)` for every field whose value changed.
    """
    if checkpoint_args is None:
        return []
    changed = []
    for field in plugin_fields():
        if field.name in RUNTIME_FIELDS or not hasattr(checkpoint_args, field.name):
            continue
        old, new = getattr(args, field.name, field.default), getattr(checkpoint_args, field.name)
        if old != new:
            changed.append((field.name, old, new))
        setattr(args, field.name, new)
    return changed
