"""`mea-model-size`: parameters, training FLOPs per token and KV-cache bytes per token of a GPT.

Takes the same flags as `pretrain_gpt_mea.py` (Megatron-LM's plus the plugin's), so a launch
script's argument set can be sized directly:

    mea-model-size --num-layers 24 --hidden-size 1408 --num-attention-heads 32 \\
        --group-query-attention --num-query-groups 4 --kv-channels 128 --swiglu \\
        --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 416 --qk-layernorm \\
        --normalization RMSNorm --untie-embeddings-and-output-weights --seq-length 8192 \\
        --vocab-size 128256 --attention-variant mea --mea-num-kv-components 2

`--help` lists the tool's own flags; `--help-all` adds Megatron-LM's and the plugin's after them.
Exit status: 0 printed; 2 a flag or a model training would refuse (the config's own checks; one
line, `mea-model-size: error: ...`).

The arithmetic (and what is counted) is documented in `megatron_mea/model/size.py`.
"""

import argparse
import json
import sys

from megatron_mea.integrations.args import add_mea_args
from megatron_mea.integrations.dry_run import DEFAULT_VOCAB_SIZE, padded_vocab_size
from megatron_mea.integrations.mlm_flags import build_parser as megatron_lm_parser
from megatron_mea.model.args import config_fields
from megatron_mea.model.size import ModelShape, model_size
from megatron_mea.runtime.argparsing import ArgumentParser

PROG = "mea-model-size"


class _HelpAll(argparse.Action):
    """`--help-all`: the tool's help, then Megatron-LM's and the plugin's flags; exit 0."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        passthrough = model_parser()
        passthrough.usage = argparse.SUPPRESS  # the tool's usage line, printed above, stands
        print(parser.format_help() + "\n" + passthrough.format_help(), end="")
        parser.exit(0)


def build_parser() -> ArgumentParser:
    """The tool's own flags; every other flag is passed on to `model_parser`."""
    parser = ArgumentParser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [-h] [--help-all] [--json] [...] <Megatron-LM and plugin flags>",
        description=__doc__.split("\n")[0],
        epilog="The model is described by the flags pretrain_gpt_mea.py takes: Megatron-LM's "
               "(--num-layers, --hidden-size, --num-attention-heads, --num-experts, ...) and the "
               "plugin's (--attention-variant, --mea-num-kv-components, --kha-variant, ...); "
               "--help-all lists them.",
    )
    parser.add_argument("--help-all", action=_HelpAll,
                        help="show also Megatron-LM's and the plugin's flags, and exit")
    parser.add_argument("--kv-bytes-per-element", type=int, default=2,
                        help="KV-cache element size: 2 (bf16) or 1 (fp8). Default: 2")
    parser.add_argument("--default-vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="vocabulary when --vocab-size is absent. Default: %(default)s")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def model_parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags (the installed megatron-core's tag) and the plugin's, as
    `pretrain_gpt_mea.py` takes them."""
    parser = add_mea_args(megatron_lm_parser())
    parser.prog = PROG  # errors name the tool (argparsing.ArgumentParser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags, then Megatron-LM's and the plugin's from the rest.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        One namespace of both, with `seq_length` and `padded_vocab_size` filled in.
    """
    own, rest = build_parser().parse_known_args(argv)
    args = model_parser().parse_args(rest, namespace=own)
    if args.seq_length is None:
        args.seq_length = args.max_position_embeddings or 4096
    args.padded_vocab_size = padded_vocab_size(args, args.default_vocab_size)
    return args


def checked_shape(args: argparse.Namespace) -> ModelShape:
    """The model of `args`, refused (one line, exit 2) where training would refuse it: the
    config's own checks run, so an impossible model (`nc` not dividing the heads, say) is not
    sized."""
    from megatron_mea.config import MEATransformerConfig

    try:
        shape = ModelShape.from_args(args)
        MEATransformerConfig(**config_fields(shape))
    except (ValueError, AssertionError, NotImplementedError) as err:
        build_parser().error(str(err).splitlines()[0] if str(err) else type(err).__name__)
    return shape


def main(argv=None) -> int:
    """Print the sizes of the model the flags describe (a table, or JSON with `--json`).

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0 (a refused flag or model exits with 2 from the parser, one line).
    """
    args = parse_args(argv)
    shape = checked_shape(args)
    size = model_size(shape, bytes_per_element=args.kv_bytes_per_element)
    if args.json:
        print(json.dumps(size, indent=1))
        return 0
    print(f"variant: {shape.attention_variant} (KV heads stored: {shape.kv_heads_stored})")
    print(f"total parameters:       {size['total_params']:>16,d}  "
          f"({size['total_params'] / 1e9:.3f}B)")
    print(f"active parameters:      {size['active_params']:>16,d}  "
          f"({size['active_params'] / 1e9:.3f}B)")
    if size["position_embedding_params"]:
        # Megatron-LM's default; a RoPE model (Llama, Qwen, the papers' models) names it.
        print(f"  of which learned positions: {size['position_embedding_params']:,d} "
              f"(--position-embedding-type {shape.position_embedding_type}; "
              "RoPE has no parameters)")
    print(f"training FLOPs / token: {size['training_flops_per_token']:>16,d}")
    print(f"KV-cache bytes / token: {size['kv_cache_bytes_per_token']:>16,d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
