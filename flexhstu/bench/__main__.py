"""``python -m flexhstu.bench ...``: the same as ``flexhstu bench ...``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
