"""Hugging Face checkpoint directories: lazy safetensors reading and sharded writing.

Reading opens every `*.safetensors` file once (memory-mapped by safetensors) and reads one tensor
at a time on request; writing collects tensors until a shard is full, writes it, and finishes with
`model.safetensors.index.json` (or a single `model.safetensors`).
"""

import json
import logging
import os
import shutil
from typing import Dict, Iterable, Optional

import torch

from megatron_mea.checkpoint.hf.config import dtype_name, split_model_type
from megatron_mea.checkpoint.errors import ConversionError

logger = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)


# Sizes config.json must state: for a missing one transformers would take its class default
# (a 7B model's), and the import would fail later on tensors that are not there.
REQUIRED_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads")
# Fields that must be integers, and numbers, where they are present and not null.
INTEGER_FIELDS = REQUIRED_FIELDS[1:] + (
    "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
    "num_experts", "num_local_experts", "num_experts_per_tok", "decoder_sparse_step",
)
NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "initializer_range", "router_aux_loss_coef")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _load_json_object(path: str) -> dict:
    """The JSON object in the file `path`; ConversionError naming the file if it is not one."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno} column "
                              f"{exc.colno})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: unreadable ({_one_line(exc)})") from exc
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def read_config_json(directory: str) -> dict:
    """The fields of `directory/config.json`, checked for what the converters read.

    Args:
        directory: an HF checkpoint directory.

    Returns:
        The parsed JSON object.

    Raises:
        ConversionError: the file is missing or not a JSON object, a `REQUIRED_FIELDS` entry is
            missing, a field has the wrong type, or the model type is not supported; the message
            names the file and the field.
    """
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ConversionError(f"{path}: missing (not a Hugging Face checkpoint directory)")
    fields = _load_json_object(path)
    for name in REQUIRED_FIELDS:
        if fields.get(name) is None:
            state = "is missing" if name not in fields else "is null"
            raise ConversionError(f"{path}: field {name!r} {state}")
    checks = [(n, int, "an integer") for n in INTEGER_FIELDS]
    checks += [(n, (int, float), "a number") for n in NUMBER_FIELDS]
    checks.append(("model_type", str, "a string"))
    for name, types, what in checks:
        value = fields.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise ConversionError(f"{path}: field {name!r} must be {what}, got {value!r}")
    try:
        split_model_type(fields["model_type"])
    except ValueError as exc:
        raise ConversionError(f"{path}: {exc}") from exc
    return fields


def load_hf_config(directory: str):
    """The transformers config of an HF checkpoint directory (local files only).

    Our native model types (`megatron_mea_*`) are registered first.

    Args:
        directory: an HF checkpoint directory.

    Returns:
        The transformers config object.

    Raises:
        ConversionError: config.json is refused by `read_config_json` or by transformers (one
            line naming the file; transformers' messages name the field).
    """
    from transformers import AutoConfig

    import megatron_mea.integrations.transformers  # noqa: F401  (registers the native model types)

    read_config_json(directory)
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, its validators' errors...
        path = os.path.join(directory, "config.json")
        raise ConversionError(f"{path}: {_one_line(exc)}") from exc


def has_tokenizer(directory: str) -> bool:
    """Whether `directory` holds tokenizer files."""
    return any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES[:3])


class HFReader:
    """Tensors of an HF safetensors checkpoint, read one at a time, with strict checks.

    Args:
        directory: holds `model.safetensors` or `model.safetensors.index.json` + shards.
    """

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            weight_map = _load_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index}: field 'weight_map' is missing or empty")
        elif os.path.exists(os.path.join(directory, SINGLE)):
            weight_map = None
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise ConversionError(
                f"{directory}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read; "
                f"found {found[:8]})"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self._handles = {}
        self.location: Dict[str, str] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise ConversionError(f"{path}: shard named by {INDEX} is missing")
            try:
                handle = safe_open(path, framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ConversionError(f"{path}: unreadable safetensors file ({exc})") from exc
            self._handles[name] = handle
            for key in handle.keys():
                self.location[key] = name
        if weight_map:
            for key, name in weight_map.items():
                if self.location.get(key) != name:
                    raise ConversionError(f"{INDEX}: tensor {key!r} is not in {name}")
        self.used = set()

    def shape(self, key: str):
        """Shape of tensor `key` without reading it."""
        return tuple(self._handles[self.location[key]].get_slice(key).get_shape())

    def get(self, key: str, shape=None) -> torch.Tensor:
        """Read tensor `key`, checking its shape against `shape` when given.

        Raises:
            ConversionError: the tensor is missing, has another shape, or is not floating-point.
        """
        if key not in self.location:
            raise ConversionError(
                f"{self.directory}: tensor {key!r}"
                + (f" {list(shape)}" if shape is not None else "")
                + " is missing"
            )
        if shape is not None and self.shape(key) != tuple(shape):
            raise ConversionError(
                f"{self.directory}: tensor {key!r} has shape {list(self.shape(key))}, the model "
                f"config implies {list(shape)}"
            )
        tensor = self._handles[self.location[key]].get_tensor(key)
        if not tensor.is_floating_point():
            # A weight stored as integers (a quantized or corrupt export) would be cast silently.
            raise ConversionError(
                f"{self.directory}: tensor {key!r} has dtype {dtype_name(tensor.dtype)}; only "
                "floating-point weights can be converted"
            )
        self.used.add(key)
        return tensor

    def unused(self):
        """Keys never read (ignoring recomputed buffers)."""
        return sorted(
            k for k in self.location if k not in self.used and not k.endswith(IGNORED_SUFFIXES)
        )


class HFWriter:
    """Write tensors to safetensors shards of at most `max_shard_bytes`, then the index.

    Args:
        directory: output directory (created).
        max_shard_bytes: shard size limit. Default: 5 GB.
    """

    def __init__(self, directory: str, max_shard_bytes: int = 5 * 1024**3):
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):
            if name.endswith(".safetensors") or name == INDEX:
                raise ConversionError(
                    f"{directory}: already holds {name}; choose an empty directory"
                )
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards = []  # (temporary file name, keys)
        self.total_bytes = 0

    def add(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Queue tensors; a full shard is written at once."""
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + size > self.max_shard_bytes:
                self._flush()
            tensor = tensor.detach()
            if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != size:
                # Own, contiguous storage: safetensors refuses views into a shared buffer.
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            self.pending[name] = tensor
            self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, os.path.join(self.directory, name), metadata={"format": "pt"})
        self.shards.append((name, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """Write the last shard and give the shards their final names (+ index if several)."""
        if self.pending:
            self._flush()
        if len(self.shards) == 1:
            os.replace(os.path.join(self.directory, self.shards[0][0]),
                       os.path.join(self.directory, SINGLE))
            return
        weight_map = {}
        for number, (tmp, keys) in enumerate(self.shards, start=1):
            final = f"model-{number:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(os.path.join(self.directory, tmp), os.path.join(self.directory, final))
            weight_map.update({key: final for key in keys})
        with open(os.path.join(self.directory, INDEX), "w", encoding="utf-8") as handle:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
                      handle, indent=2, sort_keys=True)


def copy_tokenizer(source: Optional[str], destination: str) -> Iterable[str]:
    """Copy tokenizer / generation files from `source` (if any); returns the names copied."""
    copied = []
    if source and os.path.isdir(source):
        for name in TOKENIZER_FILES:
            path = os.path.join(source, name)
            if os.path.exists(path):
                shutil.copy(path, os.path.join(destination, name))
                copied.append(name)
    return copied
