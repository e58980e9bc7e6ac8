"""Validate a `pretrain_gpt_mea.py` argument set without Megatron-LM or a GPU.

    python -m megatron_mea.cli.dry_run --world-size 16 -- <every training flag>

1. Parses the flags with Megatron-LM's own parser at one tag, rebuilt from the vendored flag table
   (`mlm_flags.py`), plus `add_mea_args`: unknown flags, missing values, bad types and bad choices
   fail as they would in Megatron-LM.
2. Applies the parts of Megatron-LM's `validate_args` that decide whether a launch can start at all
   (world-size divisibility by TP*PP*CP and by the expert grid, batch divisibility, hidden size
   by heads, layers per pipeline and virtual pipeline stage, SP with MoE+TP, experts per EP
   rank, the retain and memory-log intervals) and the defaults it fills in.
3. Builds `MEATransformerConfig` from the args the way `core_transformer_config_from_args` does
   (every arg whose name is a config field, plus its special cases), so Megatron-Core's and the
   plugin's own `__post_init__` checks run.
4. Prints a summary with the model size (`megatron_mea.model.size`); exit status 0 when valid.

The tag is the one that matches the installed megatron-core (`mlm_flags.installed_tag`: 0.16.x
validates against Megatron-LM `core_v0.16.1`, 0.17 and later against `core_v0.19.0`), unless one is
given (`tag=`, `--megatron-lm-tag`). With a tag that does not match the installed megatron-core,
step 3 copies only the flags whose value differs from that tag's default: its defaults belong to
another megatron-core release (core_v0.16.1's `--moe-deepep-num-sms 20 --moe-hybridep-num-sms 16`
are a conflict in megatron-core 0.19's config), so the installed release's defaults stand in.

It is a strict subset of Megatron-LM's validation: passing here does not promise that every
Megatron-LM assert passes, but failing here means Megatron-LM would fail too.
"""

import argparse
import contextlib
import dataclasses
import os
import warnings

from megatron_mea.integrations.args import add_mea_args
from megatron_mea.integrations.mlm_flags import build_parser, installed_tag, load_flags


# Transformer Engine version the config checks assume when TE is not installed (--te-version).
ASSUMED_TE_VERSION = "2.9.0"


# Config fields whose check is "is TE's fused kernel importable here": an environment question,
# answered on the launch machine. Without TE the dry run switches them off before building.
TE_KERNEL_FIELDS = ("apply_rope_fusion", "moe_permute_fusion")


# Vocabulary assumed for model sizes when the tokenizer is a real one (the examples' Llama-3 one).
DEFAULT_VOCAB_SIZE = 128256


class DryRunError(ValueError):
    """An argument set Megatron-LM would reject; the message lists every problem found."""


def parse_training_args(argv: list, tag: str = None) -> argparse.Namespace:
    """Parse Megatron-LM + plugin flags strictly (argparse exits with status 2 on a bad flag).

    Args:
        argv: the training flags.
        tag: the Megatron-LM tag whose flags to accept; None: `installed_tag()`.

    Returns:
        The parsed namespace, with Megatron-LM's defaults at that tag.
    """
    return training_parser(tag).parse_args(argv)


def training_parser(tag: str = None) -> argparse.ArgumentParser:
    """The flags of `pretrain_gpt_mea.py` as `mea-dry-run` takes them after its `--`: Megatron-LM's
    at `tag` (None: the installed megatron-core's) and the plugin's."""
    parser = add_mea_args(build_parser(load_flags(tag)))
    parser.prog = "mea-dry-run [...] --"  # errors name the tool (argparsing.ArgumentParser)
    return parser


# Sizes Megatron-LM multiplies and divides by before it checks them: below 1, its defaults and
# divisibility checks fail with a ZeroDivisionError instead of naming the flag.
POSITIVE_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "expert_model_parallel_size",
                  "expert_tensor_parallel_size", "micro_batch_size", "global_batch_size")


def nonpositive_sizes(args: argparse.Namespace) -> list:
    """Messages for each parallel or batch size given below 1 (None: left to its default)."""
    return [f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            for name in POSITIVE_SIZES
            if getattr(args, name) is not None and getattr(args, name) < 1]


def _fill_megatron_defaults(args: argparse.Namespace, world_size: int) -> None:
    # The defaults Megatron-LM's validate_args derives (arguments.py, the same at both tags).
    args.world_size, args.rank = world_size, 0
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    model_size = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                  * args.context_parallel_size)
    args.data_parallel_size = world_size // model_size
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        args.ffn_hidden_size = (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if (args.kv_channels is None and args.hidden_size and args.num_attention_heads
            and args.hidden_size % args.num_attention_heads == 0):  # else `check_launch` says so
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.seq_length is None:
        args.seq_length = args.encoder_seq_length
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])


def check_launch(args: argparse.Namespace) -> list:
    """Problems Megatron-LM's `validate_args` would assert on, as messages (empty: none)."""
    errors = []
    w, tp, pp, cp = (args.world_size, args.tensor_model_parallel_size,
                     args.pipeline_model_parallel_size, args.context_parallel_size)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "max_position_embeddings", "micro_batch_size"):
        if getattr(args, name) is None:
            errors.append(f"--{name.replace('_', '-')} is required")
    if errors:
        return errors
    if w % (tp * pp * cp):
        errors.append(f"world size ({w}) is not divisible by TP*PP*CP ({tp}*{pp}*{cp})")
    dp = max(args.data_parallel_size, 1)
    gbs = args.global_batch_size or args.micro_batch_size * dp
    if gbs % (args.micro_batch_size * dp):
        errors.append(f"global batch size ({gbs}) is not divisible by micro batch size "
                      f"({args.micro_batch_size}) times data parallel size ({dp})")
    if args.num_experts:
        ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
        if w % (etp * ep * pp):
            errors.append(f"world size ({w}) is not divisible by ETP*EP*PP ({etp}*{ep}*{pp})")
        if args.num_experts % ep:
            errors.append(f"--num-experts ({args.num_experts}) must be divisible by "
                          f"--expert-model-parallel-size ({ep})")
        if tp > 1 and not args.sequence_parallel:
            errors.append("MoE with tensor parallelism needs --sequence-parallel")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        # Megatron-LM derives the head size as hidden / heads only when they divide.
        errors.append(f"--hidden-size ({args.hidden_size}) must be divisible by "
                      f"--num-attention-heads ({args.num_attention_heads}) (or give --kv-channels)")
    groups = args.num_query_groups if args.group_query_attention else None
    if groups and args.num_attention_heads % groups:
        # Megatron-Core's attention divides the heads into the groups when it is built.
        errors.append(f"--num-attention-heads ({args.num_attention_heads}) must be divisible "
                      f"by --num-query-groups ({groups})")
    errors += _pipeline_split_problems(args)
    if args.max_position_embeddings < args.seq_length:
        errors.append(f"--max-position-embeddings ({args.max_position_embeddings}) is smaller "
                      f"than --seq-length ({args.seq_length})")
    if cp > 1 and args.seq_length % (2 * cp):
        errors.append(f"--seq-length ({args.seq_length}) must be a multiple of 2*CP ({2 * cp})")
    if args.train_iters is None and args.train_samples is None:
        errors.append("one of --train-iters / --train-samples is required")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        errors.append("--lr-warmup-fraction and --lr-warmup-iters are exclusive")
    if not (args.mock_data or args.data_path or args.train_data_path or args.per_split_data_args_path):
        errors.append("no data: give --data-path (or --mock-data)")
    if (tp > 1 or cp > 1) and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        # Megatron-LM asserts this before Blackwell; the example scripts export it.
        errors.append("TP or CP > 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment")
    if args.fp16 and args.bf16:
        errors.append("--fp16 and --bf16 are exclusive")
    if args.save and args.save_retain_interval is not None and args.save_interval and (
            args.save_retain_interval % args.save_interval):
        errors.append(f"--save-retain-interval ({args.save_retain_interval}) must be divisible "
                      f"by --save-interval ({args.save_interval})")
    if args.log_memory_interval is not None and args.log_memory_interval % args.log_interval:
        errors.append(f"--log-memory-interval ({args.log_memory_interval}) must be divisible by "
                      f"--log-interval ({args.log_interval})")
    return errors


def _pipeline_split_problems(args: argparse.Namespace) -> list:
    """Megatron-LM's layer split over pipeline stages (and virtual stages): the layers, plus one
    for the embedding and one for the loss where `--account-for-*-in-pipeline-split` counts
    them, are divisible by PP, and each stage's layers by `--num-layers-per-virtual-pipeline-stage`.
    Uneven splits (first/last stage layers, a layout) are left to Megatron-LM."""
    uneven = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
              args.pipeline_model_parallel_layout)
    if any(x is not None for x in uneven):
        return []
    pp = args.pipeline_model_parallel_size
    layers = (args.num_layers + bool(args.account_for_embedding_in_pipeline_split)
              + bool(args.account_for_loss_in_pipeline_split))
    counted = "" if layers == args.num_layers else f", {layers} with the embedding/loss counted"
    if layers % pp:
        return [f"--num-layers ({args.num_layers}{counted}) must be divisible by "
                f"--pipeline-model-parallel-size ({pp})"]
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if pp > 1 and per_virtual and (layers // pp) % per_virtual:
        return [f"--num-layers-per-virtual-pipeline-stage ({per_virtual}) must divide the "
                f"{layers // pp} layers of each pipeline stage"]
    return []


@contextlib.contextmanager
def _assume_transformer_engine(version: str):
    # Megatron-Core's config checks ask for the TE version (grouped GEMM, FP8 recipes) and for TE's
    # fused kernels. Without TE here, answer as the launch machine would: version checks see
    # `version`, and the kernel checks (TE_KERNEL_FIELDS) are skipped: they are not about arguments.
    from importlib.util import find_spec

    from megatron.core import utils as mcore_utils
    from packaging.version import Version

    if find_spec("transformer_engine") is not None:
        yield False
        return
    saved = mcore_utils._te_version
    mcore_utils._te_version = Version(version)
    try:
        yield True
    finally:
        mcore_utils._te_version = saved


def build_config(args: argparse.Namespace, te_version: str = ASSUMED_TE_VERSION,
                 foreign_defaults: dict = None):
    """`MEATransformerConfig` from args, as `core_transformer_config_from_args` builds it.

    Without Transformer Engine installed, TE version checks see `te_version` and the TE kernel
    fields (`TE_KERNEL_FIELDS`) are not checked (see `_assume_transformer_engine`).

    Args:
        args: parsed and defaults-filled Megatron-LM + plugin args.
        te_version: the Transformer Engine version to assume when it is not installed.
        foreign_defaults: `{dest: default}` of a Megatron-LM tag that does not match the installed
            megatron-core; args still at those defaults are left to the config's own defaults.

    Returns:
        The config; Megatron-Core's and the plugin's checks raise as they would at launch.
    """
    import torch
    import torch.nn.functional as F

    from megatron_mea.config import MEATransformerConfig

    foreign_defaults = foreign_defaults or {}
    unset = object()
    params_dtype = torch.bfloat16 if args.bf16 else torch.half if args.fp16 else torch.float
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(MEATransformerConfig)
          if hasattr(args, f.name) and getattr(args, f.name) != foreign_defaults.get(f.name, unset)}
    kw.update(
        persist_layer_norm=not args.no_persist_layer_norm,
        deallocate_pipeline_outputs=True,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        batch_p2p_comm=not args.overlap_p2p_comm,
        num_moe_experts=args.num_experts,
        rotary_interleaved=args.rotary_interleaved,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        fp8_param=args.fp8_param_gather,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        inference_sampling_seed=args.seed,
        moe_latent_size=args.moe_latent_size,
    )
    if hasattr(args, "fp4_param_gather"):  # core_v0.19.0 renamed the dest of --fp4-param-gather
        kw["fp4_param"] = args.fp4_param_gather
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True,
                  bias_activation_fusion=args.bias_swiglu_fusion)
    else:
        kw["bias_activation_fusion"] = args.bias_gelu_fusion
    if args.rope_type is None:
        kw.pop("rope_type", None)
    if len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    # Enum-typed fields arrive as names from the vendored parser.
    from megatron.core.transformer.enums import AttnBackend

    if isinstance(kw.get("attention_backend"), str):
        kw["attention_backend"] = AttnBackend[kw["attention_backend"]]
    with _assume_transformer_engine(te_version) as assumed:
        if assumed:
            kw.update({name: False for name in TE_KERNEL_FIELDS})
        return MEATransformerConfig(**kw)


def padded_vocab_size(args: argparse.Namespace, default_vocab: int = DEFAULT_VOCAB_SIZE) -> int:
    """Megatron-LM's padded vocabulary: `--vocab-size` (+1 EOD for NullTokenizer), else
    `default_vocab` (a real tokenizer's size is only known once it is loaded), rounded up to a
    multiple of `make_vocab_size_divisible_by * TP`."""
    vocab = args.vocab_size or default_vocab
    if args.vocab_size and args.tokenizer_type == "NullTokenizer":
        vocab += 1
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab // multiple) * multiple


def dry_run(argv: list, world_size: int, te_version: str = ASSUMED_TE_VERSION,
            tag: str = None) -> dict:
    """Parse, check and build the config for `argv` on `world_size` ranks; raise DryRunError.

    Args:
        argv: every training flag, as `pretrain_gpt_mea.py` would get them.
        world_size: ranks the launch starts.
        te_version: the Transformer Engine version to assume when it is not installed.
        tag: the Megatron-LM tag to validate against; None: the one matching the installed
            megatron-core (`mlm_flags.installed_tag`).

    Returns:
        `{"args": Namespace, "config": MEATransformerConfig, "size": model_size dict,
        "tag": the Megatron-LM tag used}`.
    """
    from megatron_mea.model.size import ModelShape, model_size

    tag = tag or installed_tag()
    args = parse_training_args(argv, tag)
    errors = nonpositive_sizes(args)
    if errors:
        raise DryRunError("; ".join(errors))
    _fill_megatron_defaults(args, world_size)
    errors = check_launch(args)
    if errors:
        raise DryRunError("; ".join(errors))
    foreign_defaults = None
    if tag != installed_tag():
        foreign_defaults = {rec["dest"]: rec["default"] for rec in load_flags(tag)["flags"]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = build_config(args, te_version, foreign_defaults)
    except (ValueError, AssertionError, NotImplementedError, TypeError, ImportError) as err:
        raise DryRunError(f"config: {type(err).__name__}: {err}") from err
    args.padded_vocab_size = padded_vocab_size(args)
    return {"args": args, "config": config, "size": model_size(ModelShape.from_args(args)),
            "tag": tag}
