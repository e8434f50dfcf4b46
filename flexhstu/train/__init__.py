"""``flexhstu train`` / ``torchrun --nproc-per-node N -m flexhstu.train``: train and evaluate a model.

Retrieval (next item, leave-one-out: last event test, second-to-last validation): HSTU (causal or
SLA), a SASRec-style baseline, popularity; HR@10 and NDCG@10 by full-corpus ranking (items the
user has seen are excluded). Ranking (OneRank, or the ablation without task tokens): AUC per task
and NDCG@10 within each candidate list.

Test metrics are those of the epoch with the best validation score (NDCG@10 for retrieval, mean
AUC for ranking). Every epoch's order and negatives come from generators seeded by (seed, epoch),
so resuming from a checkpoint reproduces the uninterrupted run. Under torchrun each rank trains on its shard with
DistributedDataParallel (gloo on CPU, nccl on GPU); rank 0 evaluates and writes.

Each run writes to its own folder, ``runs/<date>-<time>-<model>-<mask>`` unless ``--out`` names one, and
points ``runs/latest`` (a symlink, replaced atomically) at it; ``--resume`` without ``--out`` continues
``runs/latest``. A folder that already holds a run is refused without ``--resume``.

``main`` (``loop``) runs the steps in order: ``parse`` the arguments (``options``), ``prepare_data``
(``splits``), claim the run's folder (``run_folder``), ``build_model`` (``flexhstu.models``), ``resume`` from a
checkpoint (``run_state``), ``train_epoch`` (``epoch``) and ``evaluate`` (``evaluation``) on validation per
epoch, ``evaluate`` on test at the best epoch, ``write`` the metrics (``run_report``).
"""

from ..models import build_model
from .epoch import Diverged, checksum, epoch_batches, param_groups, train_epoch
from .evaluation import evaluate, ranking_metrics, retrieval_metrics, run_popularity, validation_score
from .loop import cli, main, train
from .options import BUILTIN_DATA, DEFAULT_LR, build_parser, check_cutoffs, data_path, model_config, parse
from .run_folder import RUNS, lock_run, resolve_out, unlock_run
from .run_report import Throughput, plot, plot_title, throughput_line, write
from .run_state import Progress, resume, run_config, save_checkpoint
from .splits import Splits, prepare_data

__all__ = [
    "BUILTIN_DATA",
    "DEFAULT_LR",
    "RUNS",
    "Diverged",
    "Progress",
    "Splits",
    "Throughput",
    "build_model",
    "build_parser",
    "check_cutoffs",
    "checksum",
    "cli",
    "data_path",
    "epoch_batches",
    "evaluate",
    "lock_run",
    "main",
    "model_config",
    "param_groups",
    "parse",
    "plot",
    "plot_title",
    "prepare_data",
    "ranking_metrics",
    "resolve_out",
    "resume",
    "retrieval_metrics",
    "run_config",
    "run_popularity",
    "save_checkpoint",
    "throughput_line",
    "train",
    "train_epoch",
    "unlock_run",
    "validation_score",
    "write",
]
