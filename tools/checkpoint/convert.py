"""Megatron-LM's `tools/checkpoint/convert.py`, here: `mea-convert` from a checkout.

    python tools/checkpoint/convert.py import-hf --hf-dir HF_DIR --save CKPT
    python tools/checkpoint/convert.py export-hf --load CKPT --save EXPORT --format native

The subcommands, flags and exit status are mea-convert's (`--help`; `megatron_mea/cli/convert.py`),
not Megatron-LM's loader/saver plugins. The package must be installed (`pip install -e .`);
the script finds it there.
"""

import sys

from megatron_mea.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
