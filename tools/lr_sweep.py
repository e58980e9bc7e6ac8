"""Learning-rate robustness sweep over baseline, MEA and KHA variants (see
`megatron_mea.cli.lr_sweep` for the flags and `megatron_mea.training.sweep` for the definitions).

    python tools/lr_sweep.py --preset cpu              # about 39 minutes on 2 CPU cores
    python tools/lr_sweep.py --preset gpu --data-path data/my_text_document
"""

import os
import sys

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mea.cli.lr_sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
