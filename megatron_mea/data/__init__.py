"""Pretraining data: tokenizers, raw text to Megatron `.bin/.idx`, and GPT dataset construction.

from megatron_mea.data import (DatasetSettings, build_gpt_datasets, build_tokenizer,
                               preprocess_files)

tok = build_tokenizer("ByteLevelTokenizer")
preprocess_files(["corpus.jsonl"], "data/corpus", tok, append_eod=True)
train, valid, test = build_gpt_datasets(DatasetSettings(
    data_prefix=["data/corpus"], split="98,2,0", seq_length=256, seed=1234,
    train_samples=1000, valid_samples=100, test_samples=0), tok)
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_mea.data.checks import DatasetError, check_dataset_files, check_splits
from megatron_mea.data.corpus import build_stdlib_corpus
from megatron_mea.data.identity import data_identity
from megatron_mea.data.preprocess import PreprocessError, PreprocessSummary, preprocess_files
from megatron_mea.data.tokenizers import (
    TOKENIZER_TYPES,
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    build_tokenizer,
)

__all__ = [
    "DatasetError",
    "DatasetSettings",
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "PreprocessError",
    "PreprocessSummary",
    "build_gpt_datasets",
    "build_gpt_datasets_rank_zero_first",
    "build_stdlib_corpus",
    "build_tokenizer",
    "preprocess_files",
]


@dataclass
class IdentifiedGPTDatasetConfig(GPTDatasetConfig):
    """Megatron's config with the data's identity, which keys the cached sample indices."""

    data_identity: dict = field(default_factory=dict)
    """{prefix: `identity.data_identity(prefix)`} of every prefix of the blend."""


class IdentifiedGPTDataset(GPTDataset):
    """Megatron's `GPTDataset` whose cache key (`unique_description_hash`, which names the
    cached document, sample and shuffle indices) includes the data's identity: data
    regenerated at the same path gets indices of its own."""

    @staticmethod
    def _key_config_attributes() -> list:
        return GPTDataset._key_config_attributes() + ["data_identity"]


@dataclass(frozen=True, kw_only=True)
class DatasetSettings:
    """What `build_gpt_datasets` builds: the data and its split, the samples to draw, their form.

    Attributes:
        seq_length: tokens per sample.
        seed: seed of the document and sample shuffles.
        train_samples, valid_samples, test_samples: samples to draw per split (None: one epoch;
            not allowed with blend weights, where an unused split takes 0). Default (valid,
            test): None.
        data_prefix: Megatron-LM `--data-path` list: ["prefix"], ["prefix1", "prefix2"]
            (weighted by size) or ["0.7", "prefix1", "0.3", "prefix2"]. Must be None or empty
            when `mock`. Default: None.
        split: Megatron-LM `--split`, e.g. "98,2,0" (ignored when `mock`). Default: "969,30,1"
            (Megatron-LM's).
        mock: use `MockGPTDataset` (synthetic token ramps) instead of files. Default: False.
        cache_dir: where the shuffle indices are cached (Megatron-LM `--data-cache-path`),
            keyed by the settings and the data's identity (`identity.data_identity`: data
            regenerated at the same path builds new indices). Default: None (Megatron's
            default, a `cache/` directory beside each prefix).
        reset_position_ids, reset_attention_mask, eod_mask_loss: as the Megatron-LM flags of the
            same names. Default: False.
        create_attention_mask: materialise an [1, s, s] causal mask per sample; not needed when
            the attention applies causality itself. Default: False.
        mmap_bin_files: mmap the .bin files rather than reading through file handles. Default:
            True.
    """

    seq_length: int
    seed: int
    train_samples: int | None
    valid_samples: int | None = None
    test_samples: int | None = None
    data_prefix: list[str] | None = None
    split: str = "969,30,1"
    mock: bool = False
    cache_dir: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    mmap_bin_files: bool = True


def build_gpt_datasets(
    settings: DatasetSettings,
    tokenizer,
    *,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple:
    """Build the train/valid/test GPT datasets with Megatron's `BlendedMegatronDatasetBuilder`.

    Each sample is a dict of `tokens`, `labels`, `loss_mask`, `position_ids` (each of shape [s],
    s = `settings.seq_length`), plus `attention_mask` [1, s, s] when
    `settings.create_attention_mask`, plus `dataset_id` when several prefixes are blended.

    Works on one process without torch.distributed, except a multi-prefix blend with a
    `cache_dir`, which Megatron's BlendedDataset only builds with a process group initialised.

    Args:
        settings: the data, its split, the samples per split and their form.
        tokenizer: a `megatron_mea.data` tokenizer; `vocab_size` and `eod` are used.
        is_built_on_rank: which ranks build datasets (Megatron-LM uses the first/last pipeline
            stage at TP rank 0). Default: every rank.

    Returns:
        (train, valid, test); an entry is None for a split of weight 0 in `split`.

    Raises:
        ValueError: if both or neither of `data_prefix` and `mock` are given, or a sample count is
            None in a weighted blend.
        FileNotFoundError: if a prefix lacks its .bin or .idx file.
        DatasetError: an empty, truncated or foreign .bin/.idx file (named), or a split of
            positive weight that gets no document (named, with the document counts).
        RuntimeError: for a multi-prefix blend with `cache_dir` while torch.distributed is not
            initialised.
    """
    data_prefix, mock, cache_dir, split = (settings.data_prefix, settings.mock,
                                           settings.cache_dir, settings.split)
    samples = [settings.train_samples, settings.valid_samples, settings.test_samples]

    if mock and data_prefix:
        raise ValueError("pass either data_prefix (--data-path) or mock (--mock-data), not both")
    if not mock and not data_prefix:
        raise ValueError("data_prefix (--data-path) is required unless mock (--mock-data) is set")

    blend = None
    if not mock:
        blend = get_blend_from_list(list(data_prefix))
        if blend[1] is not None:
            unset = [name for name, size in zip(("train", "valid", "test"), samples)
                     if size is None]
            if unset:
                # Megatron cannot size a weighted blend without a sample count (it asserts).
                raise ValueError(
                    f"{', '.join(n + '_samples' for n in unset)} must be a number (0 for an unused "
                    "split) when --data-path gives blend weights"
                )
        if cache_dir is not None and len(blend[0]) > 1 and not torch.distributed.is_initialized():
            # BlendedDataset calls torch.distributed.get_rank() when it may write its cache.
            raise RuntimeError(
                "a blend of several --data-path prefixes with a cache directory needs "
                "torch.distributed initialised (Megatron's BlendedDataset asks for the rank); "
                "initialise a process group or pass cache_dir=None"
            )
        for prefix in blend[0]:
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    raise FileNotFoundError(
                        f"--data-path prefix {prefix!r}: {prefix + suffix} does not exist"
                    )
            # Before Megatron reads them: a damaged file or an empty split named in one line.
            check_splits(prefix, check_dataset_files(prefix, cache_dir), split)

    config = (GPTDatasetConfig if mock else IdentifiedGPTDatasetConfig)(
        random_seed=settings.seed,
        sequence_length=settings.seq_length,
        blend=blend,
        split=None if mock else split,
        path_to_cache=cache_dir,
        mmap_bin_files=settings.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=settings.reset_position_ids,
        reset_attention_mask=settings.reset_attention_mask,
        eod_mask_loss=settings.eod_mask_loss,
        create_attention_mask=settings.create_attention_mask,
    )
    if not mock:
        config.data_identity = {prefix: data_identity(prefix, cache_dir) for prefix in blend[0]}
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock else IdentifiedGPTDataset,
        samples,
        is_built_on_rank or (lambda: True),
        config,
    )
    train, valid, test = builder.build()
    return train, valid, test


def build_gpt_datasets_rank_zero_first(settings: DatasetSettings, tokenizer) -> tuple:
    """`build_gpt_datasets` on every rank of the default process group, rank 0 first: it writes
    the index caches under `settings.cache_dir` (Megatron's sample indices, the record of checked
    .idx files), which the other ranks then read instead of building them again. A collective.
    """
    rank = torch.distributed.get_rank()
    if rank == 0:
        datasets = build_gpt_datasets(settings, tokenizer)
    torch.distributed.barrier()
    if rank != 0:
        datasets = build_gpt_datasets(settings, tokenizer)
    return datasets
