"""``python -m flexhstu.train ...`` (and ``torchrun ... -m flexhstu.train ...``): the same as ``flexhstu train ...``."""

import sys

from .loop import cli

if __name__ == "__main__":
    sys.exit(cli())
