"""Run several ``flexhstu train`` invocations in the same ranks (one torchrun launch, one process-group setup).

Usage: ``torchrun --standalone --nproc-per-node N tests/train/dist_runs.py STEPS.json`` where STEPS.json is a list
of ``{"argv": [...]}`` (train.main on every rank) and ``{"copy": [src, dst]}`` (rank 0 copies a run folder).
The process group is made here, so ``train`` leaves it up between runs.
"""

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from flexhstu import train

dist.init_process_group("gloo")
for step in json.loads(Path(sys.argv[1]).read_text()):
    if "copy" in step:
        if dist.get_rank() == 0:
            shutil.copytree(*step["copy"], symlinks=True)
    else:
        train.main(step["argv"])
    dist.barrier()
dist.destroy_process_group()
