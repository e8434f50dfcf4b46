"""A fixed workload for Nsight Compute: ``python benchmarks/ncu_target.py CONFIG [TILE_SET]``.

Runs four forward+backward passes of one configuration of ``benchmarks/sweep.py`` (optionally under one of
its tile sets), so that ``ncu --launch-skip`` can pick a warm launch of any kernel::

    ncu --clock-control none -k regex:dkdv --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        python benchmarks/ncu_target.py "W window 256 B8"
"""

import sys
from contextlib import nullcontext

import torch
from sweep import CONFIGS, override, setup


def main() -> int:
    cname = sys.argv[1]
    tset = sys.argv[2] if len(sys.argv) > 2 else None
    lengths, kind = CONFIGS[cname]
    with override(tset) if tset else nullcontext():
        fb = setup(lengths, kind)
        for _ in range(4):
            fb()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
