"""A run's settings as YAML: `config.yaml` of a run or a checkpoint, and `--config` files.

Keys are flag names with `-` or `_`; values are type-checked against the dataclass the file is
read into (`RunArgs`, `PretrainArgs`, ...), each error naming the file and the key. A reader of
a narrower dataclass than the one that wrote the file (the converters' and inference's `RunArgs`
from a `mea-pretrain` run's `config.yaml`) takes its own fields and leaves the rest.
"""

import ast
import dataclasses
import os
import typing
from typing import List, Literal, Tuple

import yaml

from megatron_mea.model.args import RunArgs
from megatron_mea.runtime.files import atomic_write

__all__ = ["CUSTOM_TYPES", "base_type", "load_run_args", "load_yaml", "save_config"]


def layer_pattern(value):
    """`moe_layer_freq`: an int, a list of 0/1, or either written as a string ("[0,1,1]")."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(
                f"moe_layer_freq: expected an int or a list such as [0,1,1], got {value!r}"
            ) from exc
    if isinstance(value, bool) or not (
        isinstance(value, int)
        or (isinstance(value, list) and all(v in (0, 1) and not isinstance(v, bool) for v in value))
    ):
        raise ValueError(f"moe_layer_freq: expected an int or a list of 0/1, got {value!r}")
    return value


CUSTOM_TYPES = {"moe_layer_freq": layer_pattern}
"""Fields with a parser of their own (flags and YAML alike)."""


def base_type(annotation):
    """(python type, is_list, choices) of a field annotation such as Optional[List[str]],
    Optional[Tuple[int, ...]] or Literal["a", "b"] (choices: the Literal's values, else None)."""
    args = [a for a in typing.get_args(annotation) if a not in (type(None), Ellipsis)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return base_type(args[0])
    if origin in (list, List, tuple, Tuple):
        kind, _, choices = base_type(args[0])
        return kind, True, choices
    if origin is Literal:
        return type(args[0]), False, tuple(args)
    return annotation, False, None


def _coerce(name: str, value, annotation):
    """Type-check one YAML value; raise ValueError naming the key."""
    kind, is_list, choices = base_type(annotation)
    if value is None:
        return None
    if is_list:
        value = value if isinstance(value, list) else [value]
        return [_coerce(name, v, kind) for v in value]
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{name}: expected true/false, got {value!r}")
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}")
    return value


def load_yaml(path: str, into, unknown: str = "error") -> dict:
    """Read a YAML config (safe loader) as the fields of the dataclass `into`; keys may use `-`
    or `_`.

    Args:
        unknown: a key that is not a field of `into`: `"error"` (a `--config` of a run), or
            `"ignore"` (a reader of fewer fields than the writer had).
    Raises:
        ValueError: naming the file (and the key, with its line for a YAML error)."""
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle) or {}
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the config ({exc.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"{path}: not valid YAML{at} ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of flag: value, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(into)}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            if unknown == "ignore":
                continue
            raise ValueError(f"{path}: unknown setting {key!r}")
        if name in CUSTOM_TYPES:
            values[name] = CUSTOM_TYPES[name](value)
        else:
            values[name] = _coerce(f"{path}: {key}", value, fields[name].type)
    return values


def save_config(args, directory: str) -> str:
    """Write the resolved arguments to `<directory>/config.yaml` (atomically)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.yaml")
    values = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in dataclasses.asdict(args).items()
    }
    with atomic_write(path) as handle:
        yaml.safe_dump(values, handle, sort_keys=False)
    return path


def load_run_args(path: str) -> RunArgs:
    """The `RunArgs` of a `config.yaml` (a run's or a converted checkpoint's): the model, the
    layout it was written at, the precision and the tokenizer; the training settings a run's
    file also holds are left out."""
    return RunArgs(**load_yaml(path, RunArgs, unknown="ignore"))
