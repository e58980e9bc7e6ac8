"""`python -m megatron_mea.cli.dry_run --world-size N -- <flags>`: validate a Megatron-LM launch
without a GPU or Megatron-LM (see `megatron_mea.integrations.dry_run`).

The flags are checked against the Megatron-LM tag that matches the installed megatron-core (0.16.x:
`core_v0.16.1`; 0.17 and later: `core_v0.19.0`), or the one `--megatron-lm-tag` names.

Exit status: 0 the launch is valid (a summary with the model size); 2 refused, in one line
`mea-dry-run: error: ...`: a flag Megatron-LM would not take (unknown, a missing or bad value) or a
launch it would reject (every problem found, `; `-separated)."""

import argparse
import sys

from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.integrations.dry_run import (
    ASSUMED_TE_VERSION,
    DryRunError,
    dry_run,
    training_parser,
)
from megatron_mea.integrations.mlm_flags import MEGATRON_LM_TAGS, installed_tag


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> ArgumentParser:
    """The tool's own flags, before the `--`; Megatron-LM's flags after it."""
    cli = ArgumentParser(
        prog="mea-dry-run", usage="mea-dry-run [--world-size N] [...] -- <Megatron-LM flags>",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_argument("--world-size", type=_positive_int, default=1,
                     help="ranks the launch will start. Default: 1")
    cli.add_argument("--te-version", default=ASSUMED_TE_VERSION,
                     help="Transformer Engine version to assume when it is not installed")
    cli.add_argument("--megatron-lm-tag", choices=sorted(MEGATRON_LM_TAGS), default=None,
                     help="Megatron-LM tag whose flags to validate against (default: the one "
                          f"matching the installed megatron-core, {installed_tag()})")
    cli.add_argument("--help-all", action="store_true",
                     help="show the Megatron-LM and plugin flags accepted after the --, and exit")
    return cli


def main(argv=None) -> int:
    """CLI: `mea-dry-run --world-size N -- <flags>`.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status, 0 (valid); a refusal exits with status 2 through the parser's `error`.
    """
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        own, rest = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    elif {"-h", "--help", "--help-all"} & set(argv):  # the tool's help, not Megatron-LM's
        own, rest = argv, []
    else:
        own, rest = [], argv
    cli = build_parser()
    opts = cli.parse_args(own)
    if opts.help_all:
        training_parser(opts.megatron_lm_tag).print_help()
        return 0
    try:
        result = dry_run(rest, opts.world_size, opts.te_version, opts.megatron_lm_tag)
    except DryRunError as err:  # a launch Megatron-LM would reject is a refusal of the input
        cli.error(str(err))
    args, config, size = result["args"], result["config"], result["size"]
    print(
        f"DRY RUN OK (Megatron-LM {result['tag']}): {len(rest)} argument tokens, "
        f"world size {args.world_size} = "
        f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x "
        f"CP {args.context_parallel_size} x DP {args.data_parallel_size}"
        + (f" (EP {args.expert_model_parallel_size})" if args.num_experts else "")
    )
    print(
        f"  attention_variant={config.attention_variant} "
        + (f"nc={config.mea_num_kv_components} " if config.attention_variant == "mea" else "")
        + (f"kha={config.kha_variant}{tuple(config.kha_targets)} "
           if config.attention_variant == "kha" else "")
        + f"fp8={config.fp8} fp8_recipe={config.fp8_recipe} bf16={config.bf16}"
    )
    print(
        f"  params: {size['total_params'] / 1e9:.3f}B total, {size['active_params'] / 1e9:.3f}B "
        f"active; {size['training_flops_per_token'] / 1e9:.2f} GFLOP/token (training); "
        f"KV cache {size['kv_cache_bytes_per_token']} B/token (bf16)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
