"""Megatron-LM's `tools/preprocess_data.py`, here: `mea-preprocess` from a checkout.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type ByteLevelTokenizer --append-eod

Flags, output and exit status are mea-preprocess's (`--help`; `megatron_mea/cli/preprocess.py`);
a Megatron-LM command line of this tool runs unchanged (`--workers`, `--partitions`, ... are
accepted, named in one line and ignored; `--log-interval` is honoured).
The package must be installed (`pip install -e .`); the script finds it there.
"""

import sys

from megatron_mea.cli.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
