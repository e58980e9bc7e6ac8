"""`mea-preprocess`: tokenize text files into a Megatron `.bin/.idx` dataset.

    mea-preprocess --input 'corpus/*.jsonl' notes.txt \\
        --output-prefix data/corpus --tokenizer-type ByteLevelTokenizer --append-eod

The flags are those of Megatron-LM's preprocessing tool, so its command lines run unchanged:
the ones without a meaning here (--workers, --partitions, --split-sentences, ...) are accepted,
named in one line and ignored. JSON-lines inputs (.jsonl, .ndjson, .json) hold one document per
line under --json-keys; any other file is one document. Unlike Megatron-LM, the dataset is
written to exactly <output-prefix>.bin/.idx (no `_text_document` suffix), one document per
sequence, and one worker process does the work.

Exit status: 0 when a dataset was written (malformed inputs are reported but skipped), 1 when no
document was written (one line naming the inputs) or the output could not be written (a full
disk: one line naming the output, the partial output removed), 2 on a usage error or, with
--strict, on any malformed input.
"""

import argparse
import logging
import sys

from megatron_mea.data.preprocess import (
    IGNORED_FLAGS,
    IGNORED_WHY,
    PreprocessError,
    expand_inputs,
    preprocess_files,
)
from megatron_mea.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatron_mea.runtime.argparsing import ArgumentParser


def _parse_args(argv):
    parser = ArgumentParser(prog="mea-preprocess", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="input files or glob patterns (quoted), read in the order given, "
                            "each glob sorted")
    group.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                       help="the JSON field holding the text (one key; default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None,
                       help="local tokenizer directory (HuggingFaceTokenizer only; nothing is "
                            "downloaded)")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="write <prefix>.bin and <prefix>.idx; the directory is created")
    group.add_argument("--strict", action="store_true",
                       help="treat any malformed input as fatal: write nothing and exit 2")
    group.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    group.add_argument("--max-errors-shown", type=int, default=10,
                       help="errors listed in the summary (default 10)")
    group.add_argument("--log-interval", type=int, default=None, metavar="N",
                       help="log the documents processed (docs/s, MB/s) every N documents, as "
                            "Megatron-LM's tool does (default: the progress bar only)")
    group = parser.add_argument_group(
        "Megatron-LM's flags without a meaning here (accepted; each given one is named in one "
        "line, then ignored)")
    for flag, kind in IGNORED_FLAGS:
        if kind is bool:
            group.add_argument(flag, action="store_true", help=IGNORED_WHY[_dest(flag)])
        else:
            group.add_argument(flag, type=kind, default=None, metavar="N",
                               nargs="+" if flag == "--workers-to-check" else None,
                               help=IGNORED_WHY[_dest(flag)])
    args = parser.parse_args(argv)
    if args.log_interval is not None and args.log_interval < 1:
        parser.error(f"--log-interval must be at least 1, got {args.log_interval}")
    if len(args.json_keys) != 1:
        parser.error(f"--json-keys takes one key here, got {len(args.json_keys)}")
    try:
        args.paths = expand_inputs(args.input)
    except ValueError as exc:
        parser.error(f"--input {exc}")
    return args


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def ignored_flags_note(args) -> str:
    """One line naming each given flag of `IGNORED_FLAGS` and why it means nothing here ("" for
    none)."""
    given = [f"{flag} ({IGNORED_WHY[_dest(flag)]})" for flag, _ in IGNORED_FLAGS
             if getattr(args, _dest(flag)) not in (None, False)]
    return f"mea-preprocess: ignored: {'; '.join(given)}" if given else ""


def main(argv=None) -> int:
    """Tokenize the inputs and write the dataset.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status (module docstring).
    """
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    note = ignored_flags_note(args)
    if note:
        print(note, file=sys.stderr)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except (ValueError, ImportError) as err:
        print(f"mea-preprocess: error: {err}", file=sys.stderr)
        return 2
    try:
        summary = preprocess_files(
            args.paths,
            args.output_prefix,
            tokenizer,
            json_key=args.json_keys[0],
            append_eod=args.append_eod,
            strict=args.strict,
            progress=not args.no_progress,
            log_interval=args.log_interval,
        )
    except PreprocessError as err:
        print(err.summary.describe(args.max_errors_shown))
        print("mea-preprocess: error: --strict and malformed inputs were found; nothing was "
              "written", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"mea-preprocess: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an unreadable input; a full disk (named, in plain words)
        print(f"mea-preprocess: error: {err}", file=sys.stderr)
        return 1
    print(summary.describe(args.max_errors_shown))
    if not summary.written:
        print(f"mea-preprocess: error: {summary.why_empty()}; nothing written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
