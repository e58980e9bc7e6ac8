"""Arguments of `mea-pretrain`: one typed dataclass, Megatron-LM's flag names, YAML + CLI.

A run is configured by an optional YAML file (keys are flag names with `-` or `_`) and command-line
flags that override it. Everything is validated before any process group or model exists; the
resolved arguments are saved next to the checkpoints (`<save>/config.yaml`).
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Literal, Optional, Tuple

from megatron_mea.model.args import ModelArgs, RunArgs
from megatron_mea.model.run_config import CUSTOM_TYPES, base_type, load_yaml
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.variant import AttentionVariantFields, attribute_docs

if TYPE_CHECKING:
    from megatron_mea.config import MEATransformerConfig


@dataclass
class PretrainArgs(RunArgs):
    """All settings of a pretraining run (defaults: a CPU-sized MoE GPT on mock data).

    The model's flags (`--num-layers`, `--moe-*`, the attention-variant flags `--attention-variant`,
    `--mea-*`, `--kha-*`, ...) are the fields of `ModelArgs`; the layout, precision, tokenizer
    and seed flags those of `RunArgs` (`megatron_mea.model.args`), inherited."""

    # ---- model, variant, layout, precision, tokenizer, seed: `RunArgs`'s fields -------------
    no_decay_plugin_matrices: bool = False
    """Exempt head_mix / knock matrices from weight decay (Megatron decays every 2-D param)."""
    use_distributed_optimizer: bool = False
    dist_ckpt_optim_fully_reshardable: bool = False
    """Save the distributed optimizer's state as `fully_reshardable` (resumable at any TP / PP /
    EP / DP layout) instead of Megatron-LM's default `dp_reshardable` (DP changes only)."""
    # ---- optimisation -------------------------------------------------------------------------
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_iters: int = 100
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_fraction: float = 0.05
    lr_warmup_iters: Optional[int] = None
    """Warm-up steps; when set, used instead of lr_warmup_fraction (Megatron-LM's flag)."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # ---- data ---------------------------------------------------------------------------------
    data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    """Directory of the dataset index caches (built once, reused by later runs). Default:
    data_cache/ in the run directory (--save); without --save, next to the data, which must
    then be writable."""
    # ---- checkpoints, evaluation, logging -----------------------------------------------------
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    """Start a fresh optimizer and learning-rate scheduler from the loaded weights (as
    Megatron-LM: the schedule restarts at step 0)."""
    no_load_rng: bool = False
    override_opt_param_scheduler: bool = False
    """On --load, use this run's learning-rate schedule settings instead of the checkpoint's
    (the step count still comes from the checkpoint)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On --load, use the checkpoint's learning-rate schedule settings, ignoring this run's."""
    eval_interval: int = 50
    eval_iters: int = 5
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None
    no_progress_bar: bool = False
    exit_interval: Optional[int] = None
    """Stop (after saving) once this many iterations have run in this process; for tests and
    preemption drills."""
    distributed_timeout_minutes: float = 10.0
    """How long a collective waits for the other ranks before the run fails, naming the rank
    that stopped answering (Megatron-LM's flag and default; fractions of a minute allowed)."""
    exit_signal_handler: bool = True
    """On SIGTERM, SIGINT or SIGHUP, finish the step in flight, save a checkpoint (every rank)
    and exit with 128 + the signal's number (during set-up: stop after the set-up stage in
    flight); a second Ctrl-C, or the same signal again 10 s or more after the first, exits at
    once, a quicker repeat (a launcher's forward) is ignored (Megatron-LM's flag, on by default
    here; --no-exit-signal-handler leaves the signals' default actions)."""
    nan_policy: Literal["skip", "stop"] = "skip"
    """On a NaN/Inf loss or grad norm: `skip` the update (data still advances) or `stop` the run,
    keeping the last good checkpoint."""
    nan_max_consecutive_skips: int = 10
    """With nan_policy=skip, stop after this many non-finite steps in a row."""
    # ---- run-directory safety (megatron_mea.apps.training.run_dir) ---------------------------
    exit_on_missing_checkpoint: bool = True
    """A --load without a checkpoint is an error; --no-exit-on-missing-checkpoint starts from
    scratch instead (Megatron-LM's flag, on by default here)."""
    overwrite_save: bool = False
    """Let a run that does not continue the run in --save (a fresh start, or a --load of
    another directory) write over the checkpoints there."""
    ckpt_step: Optional[int] = None
    """Load this iteration of --load instead of the latest (Megatron-LM's flag), e.g. an older
    complete checkpoint when the newest one is corrupt."""
    rewind_save: bool = False
    """With --load DIR --save DIR --ckpt-step N, move DIR's checkpoints after N aside (to
    DIR/rewound_from_iter_M) and point `latest` at N (refused without it: DIR would hold two
    runs)."""
    override_checkpoint_data_settings: bool = False
    """On --load, accept a vocabulary size, tokenizer or sequence length that differs from the
    checkpoint's (refused otherwise)."""

    @property
    def warmup_iters(self) -> int:
        """Learning-rate warm-up steps: `lr_warmup_iters`, else `lr_warmup_fraction` of the run."""
        if self.lr_warmup_iters is not None:
            return self.lr_warmup_iters
        return int(self.lr_warmup_fraction * self.train_iters)



_ALIASES = {
    "override_opt_param_scheduler": ("--override-opt_param-scheduler",),
    "use_checkpoint_opt_param_scheduler": ("--use-checkpoint-opt_param-scheduler",),
    "layernorm_epsilon": ("--norm-epsilon",),
}
# Megatron-LM's switches that clear a boolean field.
_CLEARING = {"add_bias_linear": "--disable-bias-linear"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser: one flag per `PretrainArgs` field (dest = field name), defaults
    SUPPRESSed so that only what the user typed overrides the YAML file."""
    parser = ArgumentParser(
        prog="mea-pretrain",
        description="Megatron-Core pretraining with MEA / KHA attention.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of flag: value pairs (flags override it)")
    docs = {
        **attribute_docs(AttentionVariantFields),
        **attribute_docs(ModelArgs),
        **attribute_docs(RunArgs),
        **attribute_docs(PretrainArgs),
    }
    for f in dataclasses.fields(PretrainArgs):
        help_text = docs.get(f.name, "").replace("%", "%%") or None
        if f.name in CUSTOM_TYPES:
            parser.add_argument(
                _flag(f.name), dest=f.name, type=CUSTOM_TYPES[f.name], help=help_text
            )
            continue
        kind, is_list, choices = base_type(f.type)
        if kind is bool and f.name.startswith("no_"):
            # `--no-load-optim` and the like are switches (BooleanOptionalAction would read the
            # leading "no-" as a negation and store False).
            parser.add_argument(_flag(f.name), dest=f.name, action="store_true", help=help_text)
            continue
        if kind is bool:
            parser.add_argument(
                _flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text
            )
            for alias in _ALIASES.get(f.name, ()):
                parser.add_argument(alias, dest=f.name, action="store_true")
            if f.name in _CLEARING:
                parser.add_argument(_CLEARING[f.name], dest=f.name, action="store_false")
            continue
        kwargs = dict(dest=f.name, type=kind, choices=choices, help=help_text)
        if is_list:
            kwargs["nargs"] = "+"
        parser.add_argument(_flag(f.name), *_ALIASES.get(f.name, ()), **kwargs)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> PretrainArgs:
    """YAML (if `--config`) overridden by command-line flags, then validated."""
    return parse_run(argv)[0]


def parse_run(argv: Optional[List[str]] = None) -> Tuple[PretrainArgs, "MEATransformerConfig"]:
    """`parse_args`, and the run's `MEATransformerConfig` that validation built: the one config
    of the run, for `pretrain(args, config)`."""
    namespace = vars(build_parser().parse_args(argv))
    values = load_yaml(namespace.pop("config"), PretrainArgs) if "config" in namespace else {}
    values.update(namespace)
    args = PretrainArgs(**values)
    return args, validate(args)


def validate(args: PretrainArgs, world_size: Optional[int] = None):
    """Check everything that can be checked before launch; ValueError names the flag.

    Args:
        args: the run's arguments.
        world_size: the number of processes the layout must divide. Default: `WORLD_SIZE`
            (torchrun's), else 1.

    Returns:
        The run's `MEATransformerConfig`, built to validate the architecture and the variant
        (a caller that builds the model passes it down instead of building another).
    """
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    _validate_choices(args)
    _validate_run_inputs(args)
    model_parallel = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if world_size % model_parallel:
        raise ValueError(
            f"world size ({world_size}) must be divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size x context_parallel_size ({model_parallel})"
        )
    dp = world_size // model_parallel
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(
            f"global_batch_size ({args.global_batch_size}) must be divisible by "
            f"micro_batch_size ({args.micro_batch_size}) x data-parallel size ({dp})"
        )
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        raise ValueError(
            f"num_layers ({args.num_layers}) must be divisible by pipeline_model_parallel_size "
            f"({pp})"
        )
    _validate_virtual_pipeline(args, args.global_batch_size // (args.micro_batch_size * dp))
    if args.make_vocab_size_divisible_by % args.tensor_model_parallel_size:
        raise ValueError(
            f"make_vocab_size_divisible_by ({args.make_vocab_size_divisible_by}) must be "
            f"divisible by tensor_model_parallel_size ({args.tensor_model_parallel_size})"
        )
    if not args.mock_data and not args.data_path:
        raise ValueError("data_path is required unless mock_data is set")
    _check_data_cache(args)
    for name in ("train_iters", "micro_batch_size", "log_interval", "eval_interval", "seq_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} ({getattr(args, name)}) must be >= 1")
    if args.eval_iters < 0:
        raise ValueError(f"eval_iters ({args.eval_iters}) must be >= 0 (0: no evaluation)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError(
            "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are exclusive: "
            "take the schedule from this run's flags or from the checkpoint, not both"
        )
    if args.dist_ckpt_optim_fully_reshardable and not args.use_distributed_optimizer:
        raise ValueError(
            "dist_ckpt_optim_fully_reshardable needs use_distributed_optimizer (the plain "
            "optimizer's checkpoint reshards at any layout already)"
        )
    if not args.distributed_timeout_minutes > 0:
        raise ValueError(
            f"distributed_timeout_minutes ({args.distributed_timeout_minutes}) must be > 0"
        )
    if args.save_interval is not None and args.save_interval < 1:
        raise ValueError(f"save_interval ({args.save_interval}) must be >= 1")
    if args.save_interval and not args.save:
        raise ValueError("save_interval needs save (a checkpoint directory)")
    if not 0.0 <= args.lr_warmup_fraction < 1.0:
        raise ValueError(f"lr_warmup_fraction ({args.lr_warmup_fraction}) must be in [0, 1)")
    if args.lr_warmup_iters is not None and not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ValueError(
            f"lr_warmup_iters ({args.lr_warmup_iters}) must be in [0, train_iters "
            f"({args.train_iters}))"
        )
    if args.min_lr > args.lr:
        raise ValueError(f"min_lr ({args.min_lr}) must not exceed lr ({args.lr})")
    if args.context_parallel_size > 1 and args.transformer_impl != "transformer_engine":
        raise ValueError(
            f"context_parallel_size ({args.context_parallel_size}) > 1 needs "
            "transformer_impl=transformer_engine (Megatron's local attention has no CP)"
        )
    if args.core_attention != "megatron" and args.transformer_impl != "local":
        raise ValueError(
            f"core_attention ({args.core_attention!r}) needs transformer_impl=local (the "
            "Transformer Engine spec uses TE's own core attention)"
        )
    if args.fp8_format and args.transformer_impl != "transformer_engine":
        raise ValueError("fp8_format needs transformer_impl=transformer_engine")
    for path_flag in ("data_path",):
        for path in getattr(args, path_flag) or []:
            if not _is_weight(path) and not os.path.exists(path + ".idx"):
                raise ValueError(f"{path_flag}: no dataset at {path!r} (missing {path}.idx)")
    # The model config validates the architecture and the variant fields (without any process).
    from megatron_mea.model.gpt import transformer_config

    config = transformer_config(args)
    # After the architecture's own checks (a head count TP cannot split is the first thing to
    # fix); Megatron-Core's MoE layer refuses this only at the first training forward.
    if args.num_experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ValueError(
            f"num_experts ({args.num_experts}) with tensor_model_parallel_size "
            f"({args.tensor_model_parallel_size}) > 1 needs sequence_parallel "
            "(--sequence-parallel), as Megatron-LM requires"
        )
    return config


def _validate_run_inputs(args: PretrainArgs) -> None:
    """Values that would otherwise fail only once the model is built, or hang."""
    if args.ckpt_step is not None and (args.ckpt_step < 0 or not args.load):
        raise ValueError(f"ckpt_step ({args.ckpt_step}) needs load and must be >= 0")
    for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
        if getattr(args, name) < 0:
            raise ValueError(f"{name} ({getattr(args, name)}) must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ValueError(f"{name} ({getattr(args, name)}) must be in [0, 1)")
    if args.num_experts and not 1 <= args.moe_router_topk <= args.num_experts:
        raise ValueError(
            f"moe_router_topk ({args.moe_router_topk}) must be in [1, num_experts "
            f"({args.num_experts})]"
        )
    parts = args.split.replace("/", ",").split(",")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ValueError(
            f"split ({args.split!r}) must be up to three numbers such as 969,30,1"
        ) from None
    if len(weights) > 3 or any(w < 0 or w != w for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split ({args.split!r}) must be up to three non-negative numbers "
                         "with a positive sum, such as 969,30,1")
    positions = args.max_position_embeddings
    if positions is not None and args.seq_length > positions:
        raise ValueError(f"seq_length ({args.seq_length}) must not exceed "
                         f"max_position_embeddings ({positions})")
    if args.tokenizer_model is not None and not os.path.exists(args.tokenizer_model):
        raise ValueError(f"tokenizer_model: no such file or directory {args.tokenizer_model!r}")
    if args.data_path and not args.mock_data:
        # A damaged .bin/.idx or a split without documents, named before anything starts (the
        # latter would make Megatron loop forever).
        from megatron_mea.data.checks import check_dataset_files, check_splits

        for path in args.data_path:
            if not _is_weight(path) and os.path.exists(path + ".idx"):
                check_splits(path, check_dataset_files(path, data_cache_dir(args)), args.split)


def _validate_choices(args: PretrainArgs) -> None:
    """Every field typed with a `Literal` (or a list of them) holds one of its values."""
    for f in dataclasses.fields(PretrainArgs):
        _, is_list, choices = base_type(f.type)
        value = getattr(args, f.name)
        if choices is None or value is None:
            continue
        for item in value if is_list else (value,):
            if item not in choices:
                raise ValueError(f"{f.name} ({item!r}) must be one of {choices}")


def _validate_virtual_pipeline(args: PretrainArgs, num_microbatches: int) -> None:
    """Megatron-LM's rules for `num_layers_per_virtual_pipeline_stage` and the interleaved
    schedule's micro-batch grouping (groups of PP micro-batches per model chunk)."""
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is None:
        return
    pp = args.pipeline_model_parallel_size
    if per_chunk < 1:
        raise ValueError(f"num_layers_per_virtual_pipeline_stage ({per_chunk}) must be >= 1")
    if pp < 2:
        raise ValueError(
            "num_layers_per_virtual_pipeline_stage needs pipeline_model_parallel_size > 1 "
            f"(got {pp})"
        )
    if (args.num_layers // pp) % per_chunk:
        raise ValueError(
            f"num_layers per pipeline stage ({args.num_layers // pp}) must be divisible by "
            f"num_layers_per_virtual_pipeline_stage ({per_chunk})"
        )
    if args.virtual_pipeline_model_parallel_size and num_microbatches % pp:
        raise ValueError(
            f"the interleaved pipeline schedule needs a multiple of pipeline_model_parallel_size "
            f"({pp}) micro-batches per step; global_batch_size / (micro_batch_size x "
            f"data-parallel size) is {num_microbatches}"
        )


def data_cache_dir(args: PretrainArgs) -> Optional[str]:
    """Where the dataset index caches go (`data_cache_path`'s default: the run directory, so
    read-only data works); None: next to the data, as Megatron-Core writes them."""
    if args.data_cache_path or args.mock_data or not args.save:  # mock data has no files
        return args.data_cache_path
    return os.path.join(args.save, "data_cache")


def _check_data_cache(args: PretrainArgs) -> None:
    """Data whose index caches would go next to it must be writable (Megatron-Core fails deep
    in the dataset builder otherwise)."""
    if args.mock_data or not args.data_path or data_cache_dir(args):
        return
    for prefix in dataset_prefixes(args.data_path):
        folder = os.path.dirname(os.path.abspath(prefix))
        if os.path.isdir(folder) and not os.access(folder, os.W_OK):
            raise ValueError(
                f"data_path {prefix}: {folder} is not writable for the dataset index cache; "
                "pass --data-cache-path DIR (or --save: the cache goes into the run directory)"
            )


def dataset_prefixes(data_path: List[str]) -> List[str]:
    """The dataset prefixes of a Megatron-style `--data-path` (weights left out)."""
    return [token for token in data_path if not _is_weight(token)]


def _is_weight(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False
