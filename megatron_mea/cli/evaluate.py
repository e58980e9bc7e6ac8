"""`mea-eval`: evaluate a Megatron checkpoint with lm-evaluation-harness (export on the fly).

    pip install 'megatron_mea[eval]'
    mea-eval --load runs/demo/runs/mea --tasks piqa hellaswag arc_easy --batch-size 8 --device cuda
    mea-eval --load runs/demo/runs/mea --include-path tests/eval_task --tasks mea_local_choice

The checkpoint is exported to a Hugging Face directory (a stock architecture where the variant
folds, the package's modeling code otherwise; in fp32), which the harness's `hf` model loads.
Checkpoints trained with the byte tokenizer get an equivalent HF tokenizer; others use the
tokenizer the export carries, or --tokenizer. The harness's table is printed; --output-path
also saves its results as JSON.
"""

import argparse
import json
import sys

from megatron_mea.runtime.console import configure_console
from megatron_mea.runtime.argparsing import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mea-eval", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--load", required=True,
                        help="Megatron checkpoint root or one of its iter_XXXXXXX folders")
    parser.add_argument("--iteration", "--ckpt-step", dest="iteration", type=int,
                        help="checkpoint iteration. Default: the latest")
    parser.add_argument("--tasks", nargs="+", required=True, help="lm-evaluation-harness tasks")
    parser.add_argument("--include-path", help="directory of extra YAML tasks")
    parser.add_argument("--tokenizer",
                        help="'byte-level' or an HF tokenizer directory. Default: the export's, "
                             "else byte-level for ByteLevelTokenizer checkpoints")
    parser.add_argument("--format", choices=["auto", "plain", "native"], default="auto",
                        help="HF export format. Default: auto")
    parser.add_argument("--export-dir", help="keep the HF export here. Default: a temporary one")
    parser.add_argument("--batch-size", type=int, default=1, help="Default: 1")
    parser.add_argument("--device", default="cpu", help="Default: cpu")
    parser.add_argument("--limit", type=float, help="documents per task (or fraction)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples. Default: the task's")
    parser.add_argument("--output-path", help="write the results JSON here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Megatron-Core's and the harness's INFO notices stay off the console (no run directory
    # to log them to); this package's steps and every warning are shown.
    configure_console("[mea-eval] %(message)s")
    from megatron_mea.apps.evaluation import evaluate_checkpoint

    try:
        results = evaluate_checkpoint(
            args.load, args.tasks, iteration=args.iteration, include_path=args.include_path,
            tokenizer=args.tokenizer, export_dir=args.export_dir, format=args.format, batch_size=args.batch_size,
            device=args.device, limit=args.limit, num_fewshot=args.num_fewshot,
        )
    except (ValueError, ImportError, FileNotFoundError) as exc:
        print(f"mea-eval: error: {exc}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output_path:
        with open(args.output_path, "w", encoding="utf-8") as handle:
            json.dump(results["results"], handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
