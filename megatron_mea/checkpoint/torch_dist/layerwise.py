"""Model tensors of `torch_dist` checkpoints, written and read one group (layer) at a time.

Megatron's `dist_checkpointing.save` takes the whole sharded state dict at once. The writer here
instead saves each group of tensors as its own DCP save (Megatron's global keys and offsets,
taken from the TP=1 model's sharded state dict, so SwiGLU halves, stacked layers and experts
land where Megatron expects them) and merges the parts' indexes into the one `.metadata` at the
end; Megatron writes the rest (`metadata.json`, the common state, the linears' extra states). The
reader asks DCP for one layer's region of each global tensor, so it reads only the stored chunks
overlapping it, whatever TP / PP / EP the checkpoint was saved at.
"""

import dataclasses
import logging
import os
import pickle
import shutil
import time
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensorFactory,
    apply_factories,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from megatron_mea.checkpoint.torch_dist.checks import verify_checkpoint
from megatron_mea.checkpoint.torch_dist.integrity import (
    checkpoint_files,
    checksum_files,
    read_index,
    write_checksums,
)
from megatron_mea.checkpoint.torch_dist.layout import checkpoint_dir, write_tracker
from megatron_mea.checkpoint.torch_dist.model_only import (
    MODEL_ONLY_LAYOUT,
    ConversionError,
    ModelDescription,
    layer_of,
    meta_model,
    resolve_checkpoint,
    tensor_entries,
)
from megatron_mea.checkpoint.megatron_lm.writing import CHECKPOINT_VERSION, megatron_lm_arguments
from megatron_mea.checkpoint.torch_dist.output_dir import check_new_directory, staged_directory
from megatron_mea.runtime.files import atomic_write

logger = logging.getLogger(__name__)


class _ShardPlanner(DefaultSavePlanner):
    """Save given regions of Megatron's global tensors (one group of them per DCP save)."""

    def __init__(self, parts):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = {(p.key, tuple(p.global_offset)): p for p in parts}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), part in self.parts.items():
            data = self._data(part)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=data.shape)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(data),
                    size=torch.Size(part.global_shape),
                ),
            ))
        self.plan = SavePlan(items)
        return self.plan

    @staticmethod
    def _data(part) -> torch.Tensor:
        # Stacked layers / experts are leading axes of size 1 in the stored chunk.
        return part.data.contiguous().view((1,) * part.prepend_axis_num + tuple(part.local_shape))

    def resolve_data(self, write_item):
        return self._data(self.parts[(write_item.index.fqn, tuple(write_item.index.offset))])


def _sharded_parts(entry) -> list:
    """The `ShardedTensor`s an entry saves as (a SwiGLU factory builds two)."""
    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        return list(built) if isinstance(built, (list, tuple)) else [built]
    return [entry]


def _merge_parts(directory: str, parts: list) -> None:
    """Fold the DCP indexes of the part directories into `directory/.metadata`, moving their
    data files next to it."""
    index_path = os.path.join(directory, ".metadata")
    # Written just now, but read as any index is: admitted types only.
    merged = read_index(directory)
    for number, part in enumerate(parts):
        metadata = read_index(part)
        renamed = {}
        for index, info in metadata.storage_data.items():
            if info.relative_path not in renamed:
                renamed[info.relative_path] = f"__part{number:05d}{info.relative_path}"
                os.replace(os.path.join(part, info.relative_path),
                           os.path.join(directory, renamed[info.relative_path]))
            merged.storage_data[index] = dataclasses.replace(
                info, relative_path=renamed[info.relative_path]
            )
        for key, meta in metadata.state_dict_metadata.items():
            if key in merged.state_dict_metadata:
                merged.state_dict_metadata[key].chunks.extend(meta.chunks)
            else:
                merged.state_dict_metadata[key] = meta
        shutil.rmtree(part)
    with atomic_write(index_path, "wb") as handle:
        pickle.dump(merged, handle)


def write_checkpoint(
    root: str,
    description: ModelDescription,
    groups: Iterable[Dict[str, torch.Tensor]],
    *,
    progress: bool = True,
) -> str:
    """Write a model-only checkpoint (iteration 0) of `description` from groups of tensors.

    Each group is written as soon as it arrives (its own DCP save into a part directory) and
    released; at the end the parts' indexes are merged into one `torch_dist` checkpoint, so the
    memory held is one group, not the model.

    Args:
        root: output directory, new or empty. It is written under a temporary name next to it
            and renamed at the end (`output_dir.staged_directory`): a failure leaves nothing.
        description: the model; saved as `config.yaml` + `conversion.json`.
        groups: dicts of state-dict name -> tensor (one layer each, ideally), covering every
            tensor of the model exactly once with its exact shape.
        progress: log one line per group.

    Returns:
        The checkpoint directory (`<root>/iter_0000000`).

    Raises:
        ConversionError: `root` is not a new or empty directory; a tensor that the model does
            not have, has twice, or has with another shape, or a model tensor that never came.
    """
    check_new_directory(root)
    sharded = meta_model(description).sharded_state_dict()
    entries = tensor_entries(sharded)
    started = time.perf_counter()
    with staged_directory(root) as staged:
        directory = checkpoint_dir(staged, 0)
        os.makedirs(directory)
        # Megatron writes the rest (its metadata.json, the common state, the linears' extra states)
        # first, into the empty directory (it warns of an "incomplete checkpoint" otherwise);
        # then its tensor index gains the parts.
        rest = {name: value for name, value in sharded.items() if name not in entries}
        # Megatron-LM's saved arguments and format version too: its pretrain_gpt.py continues
        # from this checkpoint (`--use-checkpoint-args --no-load-optim`).
        state = dict(model=rest, iteration=0, consumed_samples=0,
                     parallel_layout=MODEL_ONLY_LAYOUT,
                     args=megatron_lm_arguments(description.args, optimizer_saved=False),
                     checkpoint_version=CHECKPOINT_VERSION)
        dist_checkpointing.save(state, directory)
        parts = _write_groups(directory, entries, groups, progress)
        _merge_parts(directory, parts)
        write_checksums(directory, checksum_files(directory, checkpoint_files(directory)))
        description.save(staged)
        write_tracker(staged, 0)
    directory = checkpoint_dir(root, 0)
    logger.info("wrote %s (%d tensors, %.1f s)", directory, len(entries),
                time.perf_counter() - started)
    return directory


def _write_groups(tmp: str, entries: Dict, groups, progress: bool) -> list:
    """Check each group against the model's tensors and save it as a DCP part under `tmp`."""
    seen, parts = set(), []
    started = time.perf_counter()
    for index, group in enumerate(groups):
        saved, released = [], []
        for name, tensor in group.items():
            entry = entries.get(name)
            if entry is None:
                raise ConversionError(f"tensor {name!r} {list(tensor.shape)} is not in the model")
            if name in seen:
                raise ConversionError(f"tensor {name!r} was given twice")
            if tuple(tensor.shape) != tuple(entry.data.shape):
                raise ConversionError(
                    f"tensor {name!r} has shape {list(tensor.shape)}, the model expects "
                    f"{list(entry.data.shape)}"
                )
            released.append((entry, entry.data))
            entry.data = tensor.detach()
            saved += _sharded_parts(entry)
            seen.add(name)
        if saved:
            part = os.path.join(tmp, f"part{len(parts):05d}")
            dcp_save({}, storage_writer=FileSystemWriter(part), planner=_ShardPlanner(saved),
                     no_dist=True)
            parts.append(part)
        for entry, meta in released:  # drop this group's tensors
            entry.data = meta
        if progress:
            logger.info("converted group %d (%d/%d tensors, %.1f s)", index, len(seen),
                        len(entries), time.perf_counter() - started)
    missing = [name for name in entries if name not in seen]
    if missing:
        raise ConversionError(
            f"{len(missing)} model tensors were not produced, e.g. {missing[0]!r} "
            f"{list(entries[missing[0]].data.shape)}"
        )
    return parts


class _RegionPlanner(DefaultLoadPlanner):
    """Load given regions of saved global tensors into plain tensors (any saved sharding)."""

    def __init__(self, regions: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for (key, offsets), tensor in self.regions.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            requests += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk]
            )
        return LoadPlan(requests)

    def lookup_tensor(self, index):
        return self.regions[(index.fqn, tuple(index.offset))]


class SavedTensors:
    """Read the model tensors of a `torch_dist` checkpoint piece by piece.

    The checkpoint holds Megatron's global tensors (layers stacked on a leading axis in a
    homogeneous model, experts on another, SwiGLU halves side by side) in whatever TP/EP shards
    it was saved; each request reads only the stored chunks that overlap the asked region.

    Args:
        directory: the `iter_XXXXXXX` directory.
        model: a TP=1 model of the checkpoint (meta device is fine) giving keys and offsets.
    """

    def __init__(self, directory: str, model):
        self.directory = directory
        self.reader = FileSystemReader(directory)
        self.metadata = self.reader.read_metadata().state_dict_metadata
        sharded = model.sharded_state_dict()
        names = list(tensor_entries(sharded))
        apply_factories(sharded)  # SwiGLU fc1 -> its two halves
        self.parts: Dict[str, list] = {}
        for name in names:
            value = sharded[name]
            self.parts[name] = list(value) if isinstance(value, (list, tuple)) else [value]

    def read(self, names) -> Dict[str, torch.Tensor]:
        """Tensors of the given state-dict names, in the saved dtype, TP=1 shapes."""
        regions, layout = {}, {}
        for name in names:
            for part in self.parts[name]:
                saved = self.metadata[part.key]
                shape = (1,) * part.prepend_axis_num + tuple(part.local_shape)
                buffer = torch.empty(shape, dtype=saved.properties.dtype)
                regions[(part.key, tuple(part.global_offset))] = buffer
                layout.setdefault(name, []).append(buffer.view(part.local_shape))
        dcp_load({}, storage_reader=self.reader, planner=_RegionPlanner(regions), no_dist=True)
        return {
            name: parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            for name, parts in layout.items()
        }


def read_checkpoint(
    root: str, description: Optional[ModelDescription] = None, iteration: Optional[int] = None
) -> Tuple[ModelDescription, Iterator[Tuple[int, Dict[str, torch.Tensor]]]]:
    """Open a checkpoint of `mea-pretrain` (or of this tool) for reading layer by layer.

    The checkpoint is verified first (every model tensor present with its shape, no foreign
    tensor, no missing or truncated shard file): `CheckpointError` names the problem. It may have
    been saved at any TP / PP / EP.

    Returns:
        The description and an iterator of `(layer, {state-dict name: tensor})`, layer -1 being
        the embedding, final norm and output layer; tensors keep the saved dtype.
    """
    description = description or ModelDescription.load(root)
    directory = resolve_checkpoint(root, iteration)
    model = meta_model(description)
    verify_checkpoint(directory, model)
    saved = SavedTensors(directory, model)
    layers: Dict[int, list] = {}
    for name in saved.parts:
        layers.setdefault(layer_of(name), []).append(name)

    def groups():
        for layer in sorted(layers):
            yield layer, saved.read(layers[layer])

    return description, groups()
