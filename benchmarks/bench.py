"""The recorded benchmark suite (benchmarks/RESULTS.md): ``python benchmarks/bench.py [--only A,C]``."""

import sys

from flexhstu.bench import main

if __name__ == "__main__":
    sys.exit(main(["--suite", *sys.argv[1:]]))
