"""Checkpoints written by Megatron-LM's `pretrain_gpt.py`: the model and run of the arguments
it saved (`RunArgs`, which `torch_dist.model_only.ModelDescription.load` makes a description
of), and the types its common state may hold.

Megatron-LM's `save_checkpoint` (`--ckpt-format torch_dist`, tags core_v0.16.1 and core_v0.19.0)
writes, per `generate_state_dict`::

    <save>/latest_checkpointed_iteration.txt    # "<iteration>"
    <save>/iter_XXXXXXX/                        # Megatron-Core dist_checkpointing (torch_dist)
        metadata.json, .metadata, __*_*.distcp  # the sharded tensors: "model" (or "model0",
                                                # "model1", ... per virtual pipeline chunk),
                                                # "optimizer" (unless --no-save-optim), rng state
        common.pt                               # up to megatron-core 0.16: the common state

From megatron-core 0.17 the common state is not a file but one `ShardedObject` named
`common_state` inside the torch_dist files. Either way it is the state dict's non-sharded part:
`args` (the run's `argparse.Namespace`), `checkpoint_version`, `iteration`, the scheduler, ...
The model's sharded-tensor keys are `GPTModel`'s state-dict names with global layer numbers, the
same as `mea-pretrain`'s, so once described the checkpoint reads like one of ours at any TP / PP /
EP it was saved at.

The common state is read with `torch.load(weights_only=True)`: nothing is executed but the
reconstruction of the allow-listed types below (Megatron-LM's namespace holds enums of
Megatron-Core, `torch.dtype` and paths; they are kept as inert `SavedObject`s, never imported).
A type outside the list is refused, naming it.
"""

import argparse
import io
import logging
import os
import re
from typing import Dict

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_mea.checkpoint.errors import ConversionError
from megatron_mea.checkpoint.megatron_lm.saved_types import (
    MEGATRON_LM_ARGUMENT_CLASSES,
    MEGATRON_LM_ARGUMENT_CONTAINERS,
)
from megatron_mea.model.args import MODEL_FIELDS, RunArgs

logger = logging.getLogger(__name__)

COMMON_FILE = "common.pt"
COMMON_OBJECT = "common_state"


class SavedObject:
    """An object of a Megatron-LM checkpoint's common state that no model field needs (an enum
    member such as `AttnBackend.auto`, a config), kept inert: its saved class name and values."""

    saved_class = "?"

    def __init__(self, *values):
        self.values = values

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.saved_class} {self.values!r}>"


def _stand_in(qualified_name: str):
    return type(qualified_name.rsplit(".", 1)[1], (SavedObject,), {"saved_class": qualified_name})


# Types Megatron-LM's saved arguments and common state hold (declared in `saved_types`, which the
# pickle scan of `torch_dist.safe_pickle` admits too): data containers as themselves, Megatron's classes as inert stand-ins (so a
# class renamed or missing in the installed release still reads).
ALLOWED_TYPES = list(MEGATRON_LM_ARGUMENT_CONTAINERS) + [
    (_stand_in(name), name) for name in MEGATRON_LM_ARGUMENT_CLASSES
]


def common_state_types():
    """Context in which `torch.load(weights_only=True)` (Megatron-Core's `dist_checkpointing.load`
    reading a common state) accepts the types of Megatron-LM's saved arguments, and no more.

    Only the types not yet allowed are added, and only those are taken away again: torch's own
    context manager removes every type it was given on exit, which would also take back what
    Megatron-Core allows process-wide at import (`megatron.core.safe_globals`: the argument
    namespace among them), and later loads of checkpoints holding one would fail."""
    present = set(torch.serialization.get_safe_globals())
    return torch.serialization.safe_globals([t for t in ALLOWED_TYPES if t not in present])


def safe_load(source) -> object:
    """`torch.load(weights_only=True)` of a common state with the allow-list above.

    Raises:
        ConversionError: the state holds a type outside the list (named).
    """
    try:
        with common_state_types():
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError / RuntimeError naming the global
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = found.group(1) if found else " ".join(str(exc).split())[:300]
        raise ConversionError(
            f"{getattr(source, 'name', 'common state')}: not read, it holds {what}, outside the "
            "allow-list of what Megatron-LM's saved arguments hold"
        ) from exc


class _RawBytes(DefaultLoadPlanner):
    """Keeps a saved object's bytes as they are (torch's planner would unpickle them with
    `weights_only=False`); `safe_load` reads them."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.raw = {}

    def load_bytes(self, read_item, value):
        self.raw[read_item.dest_index.fqn] = value.read()


def read_common_state(directory: str) -> Dict:
    """The common (non-sharded) state of a torch_dist checkpoint directory `iter_XXXXXXX`:
    `common.pt` (megatron-core <= 0.16) or the `common_state` object (>= 0.17)."""
    legacy = os.path.join(directory, COMMON_FILE)
    if os.path.exists(legacy):
        with open(legacy, "rb") as handle:
            return safe_load(handle)
    reader = FileSystemReader(directory)
    keys = [k for k in reader.read_metadata().state_dict_metadata if k.startswith(COMMON_OBJECT)]
    if not keys:
        raise ConversionError(f"{directory}: no {COMMON_FILE} and no {COMMON_OBJECT} object")
    planner = _RawBytes()
    dcp_load({keys[0]: io.BytesIO()}, storage_reader=reader, planner=planner, no_dist=True)
    state = safe_load(io.BytesIO(planner.raw[keys[0]]))
    # Megatron-Core stores the object's data as a one-element list.
    return state[0] if isinstance(state, list) else state


# Megatron-LM arguments that change the model in ways the description cannot say: (name, the
# value that is fine, why). Checked before anything is built.
_REFUSED = (
    ("multi_latent_attention", False, "MLA checkpoints are not converted"),
    ("mtp_num_layers", None, "multi-token-prediction layers are not converted"),
    ("heterogeneous_layers_config_path", None, "heterogeneous layers are not described"),
    ("hybrid_override_pattern", None, "hybrid (Mamba) models are not GPT models"),
    ("rotary_percent", 1.0, "partial rotary embeddings are not described"),
    ("rotary_interleaved", False, "interleaved rotary embeddings are not described"),
    ("apply_layernorm_1p", False, "zero-centred norm weights are not described"),
    ("squared_relu", False, "the MLP is SwiGLU or GELU"),
    ("quick_geglu", False, "the MLP is SwiGLU or GELU"),
    ("moe_router_num_groups", None, "group-limited routing is not described"),
    ("moe_router_group_topk", None, "group-limited routing is not described"),
    ("moe_shared_expert_gate", False, "gated shared experts are not described"),
    ("moe_use_legacy_grouped_gemm", False, "the legacy grouped-GEMM layout is not read"),
    ("fp16", False, "fp16 checkpoints are not converted (bf16 and fp32 are)"),
    ("spec", None, "a custom layer spec is not described"),
)


def run_args_from_megatron_lm(args: argparse.Namespace, where: str) -> RunArgs:
    """The model (and what the checkpoint records of the run) of Megatron-LM's saved arguments
    `args` (`where`: the checkpoint, for messages).

    Raises:
        ConversionError: an argument the description cannot say (named, with its value).
    """
    for name, fine, why in _REFUSED:
        value = getattr(args, name, fine)
        if value not in (fine, None) if fine is None else value != fine:
            raise ConversionError(f"{where}: {name} ({value!r}) cannot be converted: {why}")
    if getattr(args, "position_embedding_type", "rope") not in ("rope", "learned_absolute", "none"):
        raise ConversionError(
            f"{where}: position_embedding_type ({args.position_embedding_type!r}) cannot be "
            "converted: only rope, learned_absolute and none are described"
        )
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        raise ConversionError(
            f"{where}: ckpt_format ({args.ckpt_format!r}) cannot be converted: only torch_dist"
        )
    fields = {name: getattr(args, name) for name in MODEL_FIELDS if hasattr(args, name)}
    if not getattr(args, "group_query_attention", False):
        fields["num_query_groups"] = None
    for name in ("kha_targets", "attention_variant_per_layer", "mea_num_kv_components_per_layer"):
        if fields.get(name) is not None:
            fields[name] = list(fields[name])
    # Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP and
    # saves the result; the tokenizer's size is --vocab-size (absent for some tokenizers).
    tp = args.tensor_model_parallel_size
    fields["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by * tp
    padded = getattr(args, "padded_vocab_size", None)
    if not fields.get("vocab_size"):
        if padded is None:
            raise ConversionError(f"{where}: neither vocab_size nor padded_vocab_size was saved")
        logger.warning("%s: no vocab_size saved; using the padded vocabulary (%d)", where, padded)
        fields["vocab_size"] = padded
    if args.tokenizer_type == "NullTokenizer":
        fields["vocab_size"] += 1  # Megatron-LM's NullTokenizer adds the EOD id
    run = dict(
        bf16=bool(getattr(args, "bf16", False)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        transformer_impl="local",
    )
    # The tokenizer travels with the description only when it is a Hugging Face one (a local
    # directory that the export copies and mea-generate loads); otherwise none is recorded.
    run.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        run["tokenizer_model"] = args.tokenizer_model
    else:
        logger.warning("%s: tokenizer_type %s is not a Hugging Face tokenizer: none is recorded "
                       "(the export carries no tokenizer files)", where, args.tokenizer_type)
    try:
        run_args = RunArgs(**fields, **run)
    except TypeError as exc:
        raise ConversionError(f"{where}: the saved arguments do not describe a model ({exc})")
    if padded is not None and run_args.padded_vocab_size != padded:
        raise ConversionError(
            f"{where}: padded_vocab_size ({padded}) is not vocab_size "
            f"({fields['vocab_size']}) padded to make_vocab_size_divisible_by x "
            f"tensor_model_parallel_size ({fields['make_vocab_size_divisible_by']})"
        )
    return run_args


def megatron_lm_run_args(directory: str) -> RunArgs:
    """The run arguments saved in the Megatron-LM checkpoint `directory` (an `iter_XXXXXXX`;
    `torch_dist.model_only.ModelDescription.load` finds it and makes them a description).

    Raises:
        ConversionError: no saved arguments, or arguments the description cannot say (named).
    """
    state = read_common_state(directory)
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise ConversionError(
            f"{directory}: the common state has no saved arguments (Megatron-LM's 'args')"
        )
    return run_args_from_megatron_lm(args, directory)
