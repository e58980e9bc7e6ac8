"""`python -m megatron_mea.pretrain`: the same as the `mea-pretrain` console script."""

import sys

from megatron_mea.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
