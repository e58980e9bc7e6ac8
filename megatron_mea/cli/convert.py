"""`mea-convert`: HF <-> Megatron (`torch_dist`) checkpoints, upcycling, MEA KV compression.

A thin command line over `megatron_mea.checkpoint` (the sub-commands: `megatron_mea.apps.convert`)::

    # HF -> Megatron, as the baseline, MEA (identity mixing) or KHA (identity) for continued
    # pretraining; the checkpoint loads at any TP / PP / EP
    mea-convert import-hf --hf-dir Qwen3-30B-A3B --save ckpt/qwen3 \
        --attention-variant mea [--mea-head-norm] [--tensor-model-parallel-size 4 ...]
    mea-pretrain --config ckpt/qwen3/config.yaml --load ckpt/qwen3 --save ckpt/run ...

    # Megatron -> HF: plain family architecture (baseline; MEA without head norm and
    # KHA-Linear folded) or our modeling code (`--format native`; MEA with head norm, KHA-MLP)
    mea-convert export-hf --load ckpt/run --save hf/run \
        [--format auto|plain|native] [--reference Qwen3-30B-A3B]

    # MEA post-hoc KV compression (SVD over K/V heads) and the per-layer loss probe
    mea-convert probe --load ckpt/qwen3 --num-kv-components 2 \
        --data-path data/corpus --seq-length 1024 --num-samples 32
    mea-convert compress --load ckpt/qwen3 --save ckpt/qwen3-kv2 \
        --num-kv-components 2 --layers all

Every --save must be a new or empty directory; it is written under a temporary name next to it
and renamed at the end, so a refused or failed conversion leaves nothing behind.

Exit status: 0 on success; 2 when an input is refused (one line, `mea-convert: error: ...`,
naming the file, tensor or field; usage errors too); 1 on a failure at run time.
"""

import argparse
import logging
import sys

from megatron_mea.apps import convert
from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress
from megatron_mea.variant import choices, field_help


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (one sub-command per conversion)."""
    parser = ArgumentParser(prog="mea-convert", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", action="store_true", help="only warnings and errors")
    commands = parser.add_subparsers(dest="command", required=True)
    # --quiet also after the sub-command; SUPPRESS keeps a sub-command without it from
    # resetting the one given before.
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="only warnings and errors")

    imp = commands.add_parser("import-hf", parents=[quiet],
                              help="Hugging Face safetensors -> torch_dist")
    imp.add_argument("--hf-dir", required=True,
                     help="HF model directory (config.json + safetensors)")
    imp.add_argument("--save", required=True, help="output checkpoint directory (new or empty)")
    # The variant to upcycle to; names and choices from megatron_mea.variant. The head norm is off
    # by default here: even at scale 1 it changes the function of the imported model.
    imp.add_argument("--attention-variant", choices=choices("attention_variant"),
                     default="standard")
    imp.add_argument("--mea-head-norm", action="store_true",
                     help="MEA: add the head norm (scale 1; changes the function). Default: off")
    imp.add_argument("--kha-variant", choices=choices("kha_variant"), default=None,
                     help=field_help("kha_variant"))
    imp.add_argument("--kha-targets", nargs="+", choices=choices("kha_targets"), default=None,
                     help=field_help("kha_targets"))
    imp.add_argument("--dtype", choices=tuple(convert.DTYPES), default=None,
                     help="checkpoint dtype. Default: the HF config's (bf16 or fp32)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                     help="pad the vocabulary to a multiple of this (a multiple of the "
                          "TP size). Default: 128")
    for name in ("tensor-model-parallel-size", "pipeline-model-parallel-size",
                 "expert-model-parallel-size"):
        imp.add_argument(f"--{name}", type=int, default=None,
                         help="recorded in config.yaml (the checkpoint loads at any layout)")
    imp.set_defaults(run=convert.import_hf)

    exp = commands.add_parser("export-hf", parents=[quiet],
                              help="torch_dist -> Hugging Face safetensors")
    exp.add_argument("--load", required=True, help="checkpoint directory (mea-pretrain --save)")
    exp.add_argument("--save", required=True, help="output HF directory (new or empty)")
    exp.add_argument("--format", choices=("auto", "plain", "native"), default="auto")
    exp.add_argument("--reference", default=None,
                     help="HF directory whose config.json is the template "
                          "(e.g. the model the run was upcycled from)")
    exp.add_argument("--dtype", choices=tuple(convert.DTYPES), default=None)
    exp.add_argument("--iteration", "--ckpt-step", dest="iteration", type=int, default=None,
                     help="default: the latest")
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0)
    exp.set_defaults(run=convert.export_hf)

    for name, helptext in (("compress", "MEA post-hoc KV compression (SVD over K/V heads)"),
                           ("probe", "loss increase of compressing each layer alone")):
        sub = commands.add_parser(name, parents=[quiet], help=helptext)
        sub.add_argument("--load", required=True, help="baseline or MEA checkpoint directory")
        sub.add_argument("--num-kv-components", type=int, required=True, help="nc")
        sub.add_argument("--layers", default="all",
                         help="all | paper-half | middle-half | all-but-first-N | 0,3,5-7 "
                              "(0-based, as Hugging Face numbers layers; the MEA paper's "
                              "settings: all, paper-half, all-but-first-3). Default: all")
        sub.add_argument("--iteration", "--ckpt-step", dest="iteration", type=int, default=None,
                         help="default: the latest")
        if name == "compress":
            sub.add_argument("--save", required=True,
                             help="output checkpoint directory (new or empty)")
            sub.add_argument("--mea-head-norm", action=argparse.BooleanOptionalAction,
                             default=None, help="default: keep the checkpoint's (baseline: none)")
            sub.add_argument("--mea-key-norm-before-mix", action="store_true",
                             help="apply the k norm to each component key before the mix "
                                  "(norm-then-mix: a different function, served by stock "
                                  "multi-query attention over the components); default: "
                                  "mix, then norm each composite key, as the source computes")
            sub.set_defaults(run=convert.compress)
        else:
            sub.add_argument("--data-path", required=True, help="Megatron .bin/.idx prefix")
            sub.add_argument("--seq-length", type=int, default=1024)
            sub.add_argument("--num-samples", type=int, default=16)
            sub.add_argument("--micro-batch-size", type=int, default=4)
            sub.set_defaults(run=convert.probe)
    return parser


@megatron_on_cpu()
def main(argv=None) -> int:
    """Run one conversion.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.
    Returns:
        The exit status: 0 done; 2 refused input (`mea-convert: error: ...` on stderr, one line;
        argparse's usage errors too); 1 a failure at run time (an unreadable, unwritable file).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    print_progress(convert.__name__)
    try:
        args.run(args)
    except BaseException as exc:
        refused = convert.refusal(exc, getattr(args, "save", None))
        if refused is None:
            raise
        print(refused[1], file=sys.stderr)
        return refused[0]
    return 0


if __name__ == "__main__":
    sys.exit(main())
