"""`mea-convert`'s conversions, one function per sub-command, over `megatron_mea.checkpoint`
(`args` is the namespace of `megatron_mea.cli.convert`'s parser), and how the tool reports what
stops one (`refusal`). What each writes or reads is an INFO record of this module's logger.
"""

import contextlib
import logging
import os
from typing import Optional, Tuple

import torch

from megatron_mea.runtime.files import no_room_cause

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def import_hf(args) -> None:
    """`import-hf`: a Hugging Face directory -> a torch_dist checkpoint (`--save`)."""
    from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint

    parallel = {
        name: getattr(args, name)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size")
        if getattr(args, name) is not None
    }
    import_hf_checkpoint(
        args.hf_dir,
        args.save,
        attention_variant=args.attention_variant,
        mea_head_norm=args.mea_head_norm,
        kha_variant=args.kha_variant,
        kha_targets=args.kha_targets,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        parallel=parallel,
    )
    logger.info(f"wrote {args.save} (continue with: mea-pretrain --config "
                f"{args.save}/config.yaml --load {args.save} ...)")


@contextlib.contextmanager
def _reading_load(args):
    """Yields the iteration of `--load` this command reads (`--iteration`, or the one `latest`
    names), fixed before reading; after the block, a line names what was read (a rewound run's
    directory may hold several checkpoints of one iteration over time)."""
    from megatron_mea.checkpoint.torch_dist.layout import ITER_DIR
    from megatron_mea.checkpoint.torch_dist.model_only import resolve_checkpoint

    # A missing checkpoint is refused, named; `--load DIR/iter_XXXXXXX` names its iteration.
    directory = resolve_checkpoint(args.load, args.iteration)
    iteration = int(ITER_DIR.match(os.path.basename(directory)).group(1))
    yield iteration
    logger.info(f"mea-convert {args.command}: read iteration {iteration} from {args.load}")


def _convert_load(args, convert, *positional, **options):
    """`convert(--load, --save, *positional, iteration=..., **options)`: a conversion of the
    iteration `_reading_load` fixes; returns what `convert` returns."""
    with _reading_load(args) as iteration:
        return convert(args.load, args.save, *positional, iteration=iteration, **options)


def export_hf(args) -> None:
    """`export-hf`: a checkpoint -> a Hugging Face directory, plain or native format."""
    from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint

    fmt = _convert_load(
        args,
        export_hf_checkpoint,
        format=args.format,
        reference=args.reference,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
    )
    hint = (" (import megatron_mea.integrations.transformers or pass trust_remote_code=True)"
            if fmt == "native" else "")
    logger.info(f"wrote {args.save} in the {fmt} format{hint}")


def compress(args) -> None:
    """`compress`: MEA post-hoc KV compression of a checkpoint (SVD over its K/V heads)."""
    from megatron_mea.checkpoint.transforms.compress import compress_checkpoint
    from megatron_mea.checkpoint.transforms.compress import kv_heads_per_layer

    target = _convert_load(
        args,
        compress_checkpoint,
        args.num_kv_components,
        layers=args.layers,
        mea_head_norm=args.mea_head_norm,
        mea_key_norm_before_mix=args.mea_key_norm_before_mix,
    )
    written = kv_heads_per_layer(target.config)
    logger.info(f"wrote {args.save} (MEA; K/V heads per layer, cached: {written})")


def probe(args) -> None:
    """`probe`: the loss increase of compressing each layer alone, as a table."""
    from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription
    from megatron_mea.checkpoint.transforms.compress import probe_layers, select_layers
    from megatron_mea.data.samples import load_tokens

    num_layers = ModelDescription.load(args.load).args.num_layers
    layers = select_layers(args.layers, num_layers)
    tokens = load_tokens(args.data_path, args.seq_length, args.num_samples)
    with _reading_load(args) as iteration:
        result = probe_layers(args.load, tokens, args.num_kv_components, layers=layers,
                              micro_batch_size=args.micro_batch_size, iteration=iteration)
        logger.info(result.table())


def refusal(exc: BaseException, save: Optional[str]) -> Optional[Tuple[int, str]]:
    """(exit status, the one line on stderr) of a conversion stopped by `exc`, or None for an
    error the tool lets go on as it came (a bug, Ctrl-C).

    2: a refused input (`ConversionError` and `CheckpointError` are ValueErrors). 1: a failure
    at run time: no room to write `save` (torch.save, safetensors and Python's files each say it
    their own way; the staged output is already removed), an unreadable or unwritable file.
    torch.distributed.checkpoint's `CheckpointException`, which wraps the writers' errors, is a
    BaseException.
    """
    if isinstance(exc, ValueError):
        return 2, f"mea-convert: error: {exc}"
    cause = no_room_cause(exc, save) if save else None
    if cause is not None:
        return 1, (f"mea-convert: error: {save}: {cause}; nothing written (the partial output "
                   "was removed)")
    if isinstance(exc, OSError):
        return 1, f"mea-convert: error: {exc}"
    return None
