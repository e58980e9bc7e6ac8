"""Model-only `torch_dist` checkpoints in the layout of `mea-pretrain`: description, models.

Layout (what `training_state.load_checkpoint` resumes from)::

    <root>/latest_checkpointed_iteration.txt   # "0"
    <root>/iter_0000000/                      # torch_dist: the model's tensors, nothing else
    <root>/config.yaml                        # RunArgs of the model (mea-pretrain --config)
    <root>/conversion.json                    # what config.yaml cannot say (see ModelDescription)

The converters name tensors as in `GPTModel.state_dict()` at TP=1 (local spec) and take keys,
offsets and shapes from that model built on the meta device (`meta_model`); Megatron's
dist-checkpointing reshards at load time, so one checkpoint loads at any TP / PP / EP. The
common part records `parallel_layout={"model_only": True}`, which matches no run's layout, so the
driver loads the model and starts a fresh optimizer. `layerwise` writes and reads the tensors.
"""

import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.models.gpt import GPTModel

from megatron_mea.checkpoint.errors import ConversionError
from megatron_mea.checkpoint.megatron_lm.reading import common_state_types, megatron_lm_run_args
from megatron_mea.checkpoint.torch_dist.checks import verify_checkpoint
from megatron_mea.checkpoint.torch_dist.layout import (
    TRACKER,
    checkpoint_dir,
    latest_iteration,
    missing_checkpoint,
    split_checkpoint_path,
)
from megatron_mea.config import MEATransformerConfig
from megatron_mea.model import gpt
from megatron_mea.model.args import MODEL_FIELDS, RunArgs, derived_sizes, moe_layers
from megatron_mea.model.gpt import transformer_config
from megatron_mea.model.run_config import load_run_args, save_config
from megatron_mea.runtime.files import atomic_write
from megatron_mea.runtime.process_groups import start_process_groups

logger = logging.getLogger(__name__)

CONVERSION_FILE = "conversion.json"
MODEL_ONLY_LAYOUT = {"model_only": True}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


# Every parallel dimension but TP at size 1 (the converters' layout and inference's).
UNSHARDED_BUT_TP = dict(
    pipeline_model_parallel_size=1,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=None,
    context_parallel_size=1,
    sequence_parallel=False,
)
# The layout the converters use: one process, Megatron's local modules, no FP8.
SINGLE_PROCESS_LAYOUT = dict(
    UNSHARDED_BUT_TP,
    tensor_model_parallel_size=1,
    transformer_impl="local",
    moe_grouped_gemm=False,
    fp8_format=None,
)


@dataclasses.dataclass
class ModelDescription:
    """Everything needed to rebuild the model of a checkpoint, with the facts that derive from
    it answered once at construction (the converters read them instead of deriving again).

    Attributes:
        args: the model and what its checkpoint records of the run (`RunArgs`, from
            `config.yaml`): the `megatron_mea.model.args.ModelArgs` fields, the layout it was
            written at, the dtype, the tokenizer.
        hf_config: the Hugging Face `config.json` the model came from (a template for export).
        source: the Hugging Face directory it was imported from (tokenizer and generation
            files are copied from there on export).
        resolved: `args` with every size left unset filled in (`derived_sizes`).
        moe_layers: per 0-based layer, whether it is an MoE layer (`megatron_mea.model.args.moe_layers`).
        config: the model's `MEATransformerConfig` at the converters' layout
            (`SINGLE_PROCESS_LAYOUT`, meta device); building it validates the model.

    The derived fields follow `args` as it was at construction: for other arguments, make
    another description (`dataclasses.replace(description, args=...)`).
    """

    args: RunArgs
    hf_config: Optional[Dict] = None
    source: Optional[str] = None
    resolved: RunArgs = dataclasses.field(init=False, repr=False, compare=False)
    moe_layers: Tuple[bool, ...] = dataclasses.field(init=False, repr=False, compare=False)
    config: MEATransformerConfig = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.config = transformer_config(self.converter_args(), meta=True)
        self.resolved = dataclasses.replace(self.args, **derived_sizes(self.args))
        self.moe_layers = moe_layers(self.args)

    def run_config(self):
        """The model's `MEATransformerConfig` at the run's recorded layout (validates the
        parallel sizes); the converters' layout is `config`."""
        return transformer_config(self.args)

    def converter_args(self) -> RunArgs:
        """`args` at the converters' layout (`SINGLE_PROCESS_LAYOUT`)."""
        return dataclasses.replace(self.args, **SINGLE_PROCESS_LAYOUT)

    def save(self, root: str) -> None:
        """Write `config.yaml` and `conversion.json` under `root`."""
        save_config(self.args, root)
        payload = {"hf_config": self.hf_config, "source": self.source}
        with atomic_write(os.path.join(root, CONVERSION_FILE)) as handle:
            json.dump(payload, handle, indent=2, sort_keys=True)

    @classmethod
    def load(cls, root: str) -> "ModelDescription":
        """Read the description of the checkpoint directory `root`: `config.yaml` of
        `mea-pretrain` or of this tool, else the arguments a Megatron-LM run saved in the
        checkpoint (`megatron_mea.checkpoint.megatron_lm.reading`). `root` may name one of its
        `iter_XXXXXXX` folders."""
        root, _ = split_checkpoint_path(root)
        if not os.path.isdir(root):
            raise ConversionError(f"{root}: no such directory")
        path = os.path.join(root, "config.yaml")
        if not os.path.exists(path):
            iteration = latest_iteration(root)
            if iteration is None:
                raise ConversionError(
                    f"{root}: not a checkpoint directory (no config.yaml of mea-pretrain or of "
                    f"this tool, no {TRACKER} of Megatron-LM)"
                )
            try:  # building the config validates it
                return cls(megatron_lm_run_args(checkpoint_dir(root, iteration)))
            except AssertionError as exc:  # Megatron-Core's own checks
                raise ConversionError(
                    f"{root}: the saved arguments do not describe a model ({exc})"
                ) from exc
        args = load_run_args(path)
        payload = {}
        extra = os.path.join(root, CONVERSION_FILE)
        if os.path.exists(extra):
            with open(extra, encoding="utf-8") as handle:
                payload = json.load(handle)
        # Files written before the model description was declared once kept the model fields
        # the run arguments lacked then under "overrides"; they are model fields now.
        legacy = payload.get("overrides") or {}
        unknown = sorted(set(legacy) - set(MODEL_FIELDS))
        if unknown:
            raise ConversionError(f"{extra}: overrides {unknown} are not model fields")
        if legacy:
            args = dataclasses.replace(args, **legacy)
        return cls(args, payload.get("hf_config"), payload.get("source"))


@contextlib.contextmanager
def converter_process() -> Iterator[None]:
    """Run the block in a gloo world of one process with Megatron's parallel state at size 1.

    Reuses an initialised world of one (as the tests' `single_rank` fixture sets up). Without
    CUDA, call it inside `megatron_mea.cpu.megatron_on_cpu()` (the converter CLI does).
    """
    from megatron_mea.cpu import init_cpu_rng_tracker

    own_group = not dist.is_initialized()
    if not own_group and dist.get_world_size() != 1:
        raise RuntimeError("the checkpoint converters run in a single process (world size 1)")
    own_state = not parallel_state.model_parallel_is_initialized()
    if not own_state and (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
    ) != (1, 1, 1):
        raise RuntimeError("the checkpoint converters need Megatron's parallel state at size 1")
    if own_state:
        start_process_groups("gloo", rank=0, world_size=1)
        init_cpu_rng_tracker()  # the probe runs real models (CUDA trackers on a GPU)
    try:
        yield
    finally:
        if own_state:
            parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def meta_model(description: ModelDescription) -> GPTModel:
    """The TP=1 model of `description` on the meta device (no memory for its weights)."""
    return gpt.build_model(
        description.converter_args(), description.config, core_attention="megatron",
        placement="meta",
    )


def layer_of(name: str) -> int:
    """Layer index of a state-dict name, -1 for embedding / final norm / output layer."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def layer_name(layer: int) -> str:
    """How a console line names a `layer_of` group: `layer N`, or what -1 holds."""
    return f"layer {layer}" if layer >= 0 else "the embedding, final norm and output layer"


def tensor_entries(sharded: Dict) -> Dict[str, object]:
    """State-dict name -> `ShardedTensor` / `ShardedTensorFactory` of a model's sharded state
    dict (the same objects: setting their `data` fills `sharded`)."""
    return {
        name: entry
        for name, entry in sharded.items()
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory))
    }


def expected_shapes(description: ModelDescription) -> Dict[str, Tuple[int, ...]]:
    """State-dict name -> shape of every tensor of the model (TP=1)."""
    entries = tensor_entries(meta_model(description).sharded_state_dict())
    return {name: tuple(entry.data.shape) for name, entry in entries.items()}


def resolve_checkpoint(root: str, iteration: Optional[int] = None) -> str:
    """The `iter_XXXXXXX` directory of `root` (the latest unless `iteration` is given; `root`
    may name the folder itself)."""
    root, iteration = split_checkpoint_path(root, iteration)
    if not os.path.isdir(root):
        raise ConversionError(f"{root}: no such directory")
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise ConversionError(f"{root}: no {TRACKER} (not a checkpoint directory)")
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        raise ConversionError(missing_checkpoint(directory))
    return directory


def load_model_weights(model, root: str, iteration: Optional[int] = None) -> None:
    """Load the model tensors of a checkpoint into `model` (any TP / PP / EP; all ranks call)."""
    directory = resolve_checkpoint(root, iteration)
    verify_checkpoint(directory, model)
    with common_state_types():  # a Megatron-LM checkpoint's common state holds its arguments
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"])


def build_stage_model(description: ModelDescription, **parallel) -> GPTModel:
    """The real model of `description` for this rank's pipeline stage (call inside an
    initialised parallel state: the stage and the sizes come from it), unwrapped, with the
    recorded sizes overridden by `parallel`; built by `megatron_mea.model.gpt.build_model`.

    Args:
        description: the model.
        parallel: `RunArgs` parallel sizes to use instead of the recorded ones, e.g.
            `tensor_model_parallel_size=2` (they must match Megatron's parallel state).
    """
    if parallel:
        description = dataclasses.replace(
            description, args=dataclasses.replace(description.args, **parallel)
        )
    return gpt.build_model(
        description.args,
        description.run_config(),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        core_attention="megatron",
        placement="built",
    )
