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

``main`` runs the steps in order: ``parse`` the arguments, ``prepare_data``, ``build_model``,
``resume`` from a checkpoint, ``train_epoch`` and ``evaluate`` on validation per epoch, ``evaluate``
on test at the best epoch, ``write`` the metrics.
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from . import checkpoint, distributed
from .cli.common import (
    Parser,
    RunFailure,
    checked_device,
    non_negative_int,
    output_files,
    positive_int,
    run,
    user_input,
)
from .data import data_digest, load, synthetic
from .data.movielens import parse_columns
from .data.sequences import UserSequences, leave_one_out, user_sequences
from .data.synthetic_source import LazyItem, SyntheticSource
from .metrics import auc, gauc, list_ndcg, metric_key, parse_metrics, ranks_to_metrics, target_rank
from .models import ModelConfig, Popularity, build_model, make_batch, make_requests
from .models.ranking import TASKS, RankingRequests, collate, min_events
from .nn import onerank_loss
from .run_settings import FIXED_ON_RESUME, SYNTHETIC_DEFAULTS, saved_config

BUILTIN_DATA = ("ml-100k", "synthetic")


def data_path(data: str) -> str:
    """``--data`` as a run records it: a file as an absolute path (``--resume`` and ``flexhstu recommend`` read it
    again from any directory; a relative one would name another file there), a built-in name as given."""
    return data if data in BUILTIN_DATA else os.path.abspath(data)


IDS_IN_CHECKPOINT = 1 << 20  # a synthetic run records its ids (1..n) for `recommend` up to this many
WARMUP_STEPS = 3  # steps of each invocation left out of the steady tokens/s (allocation, kernel compilation)


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {value}")
    return value


def _columns(text: str) -> dict[str, str]:
    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--columns: ")) from None


def _at_least_3(text: str) -> int:
    value = non_negative_int(text)
    if value < 3:
        raise argparse.ArgumentTypeError(f"expected an integer >= 3 (one event to train on, one to validate, one "
                                         f"to test), got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return value


def build_parser() -> Parser:
    """The ``flexhstu train`` parser: every option with a sentence (and its default in ``--help``)."""
    p = Parser(prog="flexhstu train", description="Train and evaluate a model (under torchrun: python -m "
                                                  "flexhstu.train, one shard per rank).")
    p.add_argument("--task", choices=["retrieval", "ranking"], default="retrieval",
                   help="next-item retrieval, or multi-task ranking of candidate lists")
    p.add_argument("--model", choices=["hstu", "onerank", "sasrec", "popularity"], default="hstu",
                   help="hstu, sasrec (softmax baseline) or popularity for retrieval; onerank for ranking")
    p.add_argument("--data", default="ml-100k",
                   help="ml-100k, synthetic, a ratings.dat / ratings.csv / .parquet path, or any CSV / Parquet file "
                        "of interactions with --columns")
    p.add_argument("--synthetic-users", type=positive_int, default=None,
                   help=f"users of --data synthetic (not given: {SYNTHETIC_DEFAULTS['synthetic_users']}); each user's "
                        "events are generated when read, so 10^6 users cost only their lengths in memory")
    p.add_argument("--synthetic-items", type=positive_int, default=None,
                   help=f"items of --data synthetic (not given: {SYNTHETIC_DEFAULTS['synthetic_items']})")
    p.add_argument("--synthetic-len", type=_at_least_3, default=None,
                   help=f"most events of a user of --data synthetic (not given: "
                        f"{SYNTHETIC_DEFAULTS['synthetic_len']}); lengths are uniform from half of it")
    p.add_argument("--columns", type=_columns, default=None,
                   help="the --data file's column names, e.g. user=uid,item=iid,time=ts,rating=r (rating is "
                        "optional: 1.0 for every event without it); ids may be integers or strings, time integers")
    p.add_argument("--mask", choices=["causal", "sla"], default="causal", help="hstu's attention mask")
    p.add_argument("--sla-k1", type=positive_int, default=32, help="sla: local causal window K1")
    p.add_argument("--sla-k2", type=non_negative_int, default=4, help="sla: global prefix K2")
    p.add_argument("--no-rel-bias", action="store_true",
                   help="hstu ablation: no relative attention bias (per relative position and time-gap bucket)")
    p.add_argument("--no-task-tokens", action="store_true",
                   help="ranking ablation: plain target tokens, fixed targets mask")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="default: 60 for retrieval, 4 for ranking; on --resume, a new value extends (or ends) the run")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="sequences (or requests) per step, split across the ranks under torchrun")
    p.add_argument("--steps-per-epoch", type=non_negative_int, default=0,
                   help="train on the first N batches of each epoch's order only (0: all)")
    p.add_argument("--dim", type=positive_int, default=64, help="model width")
    p.add_argument("--layers", type=positive_int, default=2, help="attention layers")
    p.add_argument("--heads", type=positive_int, default=2, help="must divide --dim")
    p.add_argument("--max-len", type=positive_int, default=100, help="the last events of a history that are used")
    p.add_argument("--dropout", type=_probability, default=0.2, help="dropout rate of embeddings and layers")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help=f"learning rate (default {DEFAULT_LR:g}); on --resume, the checkpoint's unless given")
    p.add_argument("--negatives", type=positive_int, default=256,
                   help="retrieval: sampled negatives per step of the sampled softmax")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the weights, the order and the negatives")
    p.add_argument("--eval-users", type=non_negative_int, default=0,
                   help="validate and test on a fixed random sample of N users (ranking: requests); 0: all")
    p.add_argument("--shard-embeddings", choices=distributed.SHARDING, default="none",
                   help="under torchrun, the item table: whole on every rank (none), split by rows (rowwise: a "
                        "DTensor; no rank ever holds more than its rows) or FSDP2's fully_shard (fsdp: sharded "
                        "between steps, gathered whole for each step). Sharded runs save torch.distributed."
                        "checkpoint folders, resumable on any number of ranks")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="write no checkpoint (benchmarks); the test metrics are then the last epoch's")
    p.add_argument("--out", default=None,
                   help="the run's folder, not a filesystem root or the home folder itself (default: a new "
                        "runs/<date>-<time>-<model>-<mask>, and runs/latest points to it; with --resume: runs/latest)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt (which must exist). Refused if any of "
                        + ", ".join("--" + k.replace("_", "-") for k in FIXED_ON_RESUME)
                        + " or the data file's contents differ from the checkpoint's run; --lr and --epochs may "
                          "change (reported on stderr); --out, --device, --stop-after, --no-checkpoint, --quiet, "
                          "--debug and the number of ranks are free")
    p.add_argument("--stop-after", type=non_negative_int, default=0,
                   help="stop after this many epochs of this invocation (tests)")
    p.add_argument("--metrics", default=None,
                   help="extra evaluation metrics, comma-separated: hr@K, ndcg@K, mrr for retrieval; auc, gauc, "
                        "ndcg@K for ranking (e.g. hr@50,ndcg@200,mrr). HR@10 and NDCG@10 (retrieval) or AUC and "
                        "NDCG@10 per task (ranking) are always reported")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (cuda when available)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    return p


def parse(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    a.data = data_path(a.data)
    if not a.resume:  # on --resume, what is not given is the checkpoint's (resume)
        if a.epochs is None:
            a.epochs = 60 if a.task == "retrieval" else 4
        if a.lr is None:
            a.lr = DEFAULT_LR
    if a.task == "ranking" and a.model not in ("onerank",):
        p.error(f"--model: ranking trains 'onerank' (use --no-task-tokens for the ablation), got {a.model!r}")
    if a.task == "retrieval" and a.model == "onerank":
        p.error("--model onerank needs --task ranking")
    if a.dim % a.heads:
        p.error(f"--heads: expected a divisor of --dim {a.dim}, got {a.heads}")
    try:
        a.metric_names = parse_metrics(a.metrics, a.task)
    except ValueError as e:
        p.error(str(e))
    for key, default in SYNTHETIC_DEFAULTS.items():
        given = getattr(a, key, None)
        if a.data != "synthetic" and given is not None:
            p.error(f"--{key.replace('_', '-')}: expected --data synthetic, got --data {a.data}")
        setattr(a, key, (default if given is None else given) if a.data == "synthetic" else None)
    if a.no_rel_bias and a.model != "hstu":
        p.error(f"--no-rel-bias: expected --model hstu (the only model with a relative bias), got --model {a.model}")
    if a.mask != "causal" and a.model != "hstu":  # a mask the model has no use for would be ignored in silence
        p.error(f"--mask: expected causal (the default) for --model {a.model}, which has no mask choice, "
                f"got {a.mask}")
    if a.no_task_tokens and a.model != "onerank":
        p.error(f"--no-task-tokens: expected --task ranking --model onerank, got --model {a.model}")
    if a.model == "popularity" and a.shard_embeddings != "none":
        p.error("--shard-embeddings: expected none for --model popularity (it has no item table), "
                f"got {a.shard_embeddings}")
    return a


def model_config(a: argparse.Namespace) -> ModelConfig:
    """The model settings of the parsed options ``a``: the one place the training code converts them."""
    return ModelConfig.from_settings(vars(a))


def check_cutoffs(a: argparse.Namespace, num_items: int) -> None:
    """Retrieval ranks the whole catalogue: a cut-off K at or above its size puts every item in the top K, so
    HR@K is 1 whatever the model (HR@10 = NDCG@10 = 1.0 with 5 items), a result that says nothing."""
    if a.task != "retrieval":
        return
    cuts = {name: int(name.partition("@")[2]) for name in a.metric_names if "@" in name}
    name, k = max(cuts.items(), key=lambda kv: kv[1], default=("", 0))
    if k >= num_items:
        arg = ("--metrics" if a.metrics and name in a.metrics.lower()
               else "--synthetic-items" if a.data == "synthetic" else "--data")
        raise ValueError(f"{arg}: expected a catalogue of more than {k} items for {name} (every item ranks in the "
                         f"top {k} of {num_items}: the metric would be 1 whatever the model), got {num_items} items")


def resolve_device(a: argparse.Namespace, rank: int) -> torch.device:
    device = checked_device(a.device)
    if device.type == "cuda":
        if device.index is None:
            local = int(os.environ.get("LOCAL_RANK", rank))
            device = torch.device(f"cuda:{local % torch.cuda.device_count()}")
        torch.cuda.set_device(device)  # NCCL and DeviceMesh use the current device
    return device


RUNS = Path("runs")
DEFAULT_LR = 3e-3


def run_label(a: argparse.Namespace) -> str:
    """``<model>-<mask>`` of a run's folder name."""
    if a.model == "hstu":
        return f"hstu-{a.mask}"
    if a.model == "onerank":
        return "onerank-" + ("targets" if a.no_task_tokens else "tasktokens")
    return {"sasrec": "sasrec-causal", "popularity": "popularity"}[a.model]


def new_run_folder(a: argparse.Namespace, root: Path = RUNS) -> Path:
    """A fresh ``root/<date>-<time>-<model>-<mask>`` (``-2``, ``-3``... when runs start in the same second)."""
    root.mkdir(parents=True, exist_ok=True)
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{run_label(a)}"
    for n in itertools.count(1):
        out = root / (base if n == 1 else f"{base}-{n}")
        try:
            out.mkdir()
            return out
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def check_latest(root: Path = RUNS) -> Path:
    """``root/latest``, after checking that it is a symlink or absent (a run may replace it)."""
    link = root / "latest"
    if link.exists() and not link.is_symlink():
        raise ValueError(f"{link}: expected a symlink to the newest run, got a folder (written by an older "
                         f"flexhstu); rename it (e.g. mv {link} {root}/old) or pass --out")
    return link


def point_latest(out: Path, root: Path = RUNS) -> None:
    """Make ``root/latest`` a symlink to ``out``: a new link renamed over the old one, so readers never see
    a missing or half-made link."""
    link = check_latest(root)
    tmp = root / f".latest.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(out.name, tmp)  # relative: the runs folder can move
    os.replace(tmp, link)


_LOCKS: dict[Path, object] = {}  # the open lock files of this process's runs (train releases them at its end)
_LATEST_PENDING: set[Path] = set()  # new runs of this process that runs/latest does not point to yet


def lock_run(out: Path) -> None:
    """Hold ``out/.lock`` until ``unlock_run`` (or the process's end: a killed run leaves no stale lock), or raise
    if another run holds it: two runs writing one folder would leave the metrics of one beside the checkpoint of
    the other."""
    f = open(out / ".lock", "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"--out: expected a folder no other flexhstu train is writing, got {out} (another process "
                         "holds its .lock; wait for it to end, or pass another --out)") from None
    _LOCKS[out] = f


def unlock_run(out: Path) -> None:
    f = _LOCKS.pop(out, None)
    if f is not None:
        f.close()  # closing the file releases its lock


def latest_after_output(out: Path, rank: int) -> None:
    """Point ``runs/latest`` at a new run once it holds an output: a run killed before its first checkpoint
    leaves ``runs/latest`` (and ``--resume``) on the run before it."""
    if rank == 0 and out in _LATEST_PENDING:
        point_latest(out)
        _LATEST_PENDING.discard(out)


def resolve_out(a: argparse.Namespace, rank: int, world: int) -> Path:
    """The run's folder: ``--out``; else ``runs/latest`` on ``--resume``; else a new folder that ``runs/latest``
    then points to. Rank 0 makes, checks and locks it and sends the other ranks its name, or the error that
    stopped it (so that they stop too, rather than wait for it in the first collective)."""
    shared: list = [None, None]  # the folder's name, rank 0's error
    if rank == 0:
        try:
            shared[0] = str(_claim_out(a))
        except (ValueError, OSError) as e:
            if world == 1:
                raise
            shared[1] = f"{e.strerror}: '{e.filename}'" if isinstance(e, OSError) and e.strerror else str(e)
    if world > 1:
        dist.broadcast_object_list(shared, src=0)
        if shared[1] is not None:
            raise ValueError(shared[1])
    return Path(shared[0])


def refuse_shared_folder(out: Path) -> None:
    """``--out`` naming a folder that holds much besides a run (a filesystem root, the home folder itself) is a
    slip (``--out /``, ``--out ~`` for ``~/run``): the run would scatter its files and .lock among the user's."""
    where = out.resolve()
    why = ("the filesystem root" if where == Path(where.anchor) else
           "the home folder itself" if where == Path.home().resolve() else None)
    if why:
        raise ValueError(f"--out: expected a folder of its own for the run (e.g. runs/NAME), got {out} ({why})")


def _claim_out(a: argparse.Namespace) -> Path:
    """``resolve_out`` on rank 0: the folder, made, checked (no other run in it) and locked."""
    if a.out is not None:
        out = Path(a.out)
        refuse_shared_folder(out)
    elif a.resume:
        latest = RUNS / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"--resume: expected {latest} (the newest run), no such run; pass --out FOLDER")
        out = latest.resolve()
    else:
        check_latest()  # before the run: it could not point runs/latest at its folder
        out = new_run_folder(a)
        _LATEST_PENDING.add(out)  # runs/latest moves once the run has written an output (latest_after_output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: expected a folder, got {out} (a file)")
    out.mkdir(parents=True, exist_ok=True)
    held = [f for f in ("checkpoint.pt", "metrics.json") if (out / f).exists()]
    if held and not a.resume:
        raise ValueError(f"--out: expected a folder without a run, got {out} holding {', '.join(held)} (pass "
                         "--resume to continue it, or leave out --out for a new folder)")
    lock_run(out)
    return out


@dataclass
class Splits:
    """The data of one run. Retrieval: ``seqs`` with the leave-one-out ``valid``/``test`` item of each user and
    the training prefixes ``train_items``. Ranking: request sets. ``units``: what an epoch shuffles."""

    num_items: int
    data_rows: int
    units: list[int]
    seqs: UserSequences
    valid: list[int] | RankingRequests
    test: list[int] | RankingRequests
    train_items: list[np.ndarray] = field(default_factory=list)
    train_req: RankingRequests | None = None
    item_ids: list = field(default_factory=list)  # the data file's id of item i at [i - 1]
    user_ids: list = field(default_factory=list)  # the data file's id of the user of sequence s at [s]
    weights: np.ndarray | None = None  # per unit, what its loss is a mean over: targets (retrieval), candidates
    digest: str | None = None  # data_digest of the events read (None for synthetic data: its arguments say all)
    duplicates: int = 0  # exact duplicate events the data file held (dropped)


@dataclass
class Progress:
    """What a checkpoint carries besides the weights: per-epoch records, epochs done, the best validation epoch."""

    history: list[dict] = field(default_factory=list)
    epoch: int = 0
    best: dict = field(default_factory=lambda: {"score": -math.inf, "epoch": 0, "model": None})


def prepare_data(a: argparse.Namespace) -> Splits:
    if a.data == "synthetic" and a.columns:
        raise ValueError("--columns: expected a CSV or Parquet --data file, got --data synthetic")
    if a.data == "synthetic" and a.task == "retrieval":
        return synthetic_retrieval(a)
    if a.data == "synthetic":
        data = synthetic(a.synthetic_users, a.synthetic_items, a.synthetic_len)
    else:
        data = load(a.data, columns=a.columns)
    ids = file_ids(data, user_sequences(data))
    ids["digest"] = None if a.data == "synthetic" else data_digest(data)
    ids["duplicates"] = data.duplicates
    if a.task == "retrieval":
        seqs, valid, test = leave_one_out(data)
        if not seqs.items:
            raise ValueError(f"--data {a.data}: expected a user with 3 or more events (one to train on, one to "
                             f"validate, one to test), got none; most events of a user: {_most_events(data)}")
        train_items = [x[:-2] for x in seqs.items]
        return Splits(data.num_items, len(data), list(range(len(seqs.items))), seqs, valid, test,
                      train_items=train_items, **ids, weights=_targets(np.array([len(x) for x in train_items]), a))
    seqs = user_sequences(data)
    train_req = make_requests(seqs, "train", max_len=a.max_len, seed=a.seed)
    valid_req = make_requests(seqs, "valid", max_len=a.max_len, seed=a.seed + 1)
    test_req = make_requests(seqs, "test", max_len=a.max_len, seed=a.seed + 2)
    if not train_req.cand_items:
        raise ValueError(f"--data {a.data}: ranking expected a user with {min_events()} or more events (and as many "
                         f"unseen items as negatives), got none; most events of a user: {_most_events(data)}")
    return Splits(data.num_items, len(data), list(range(len(train_req.cand_items))), seqs, valid_req, test_req,
                  train_req=train_req, **ids, weights=np.array([len(c) for c in train_req.cand_items]))


def _targets(train_lengths: np.ndarray, a: argparse.Namespace) -> np.ndarray:
    """Next-item targets of each training sequence in a batch (``make_batch``: the last ``max_len`` inputs)."""
    return np.minimum(np.maximum(train_lengths - 1, 0), a.max_len)


def synthetic_retrieval(a: argparse.Namespace) -> Splits:
    """Leave-one-out splits of ``--data synthetic`` whose users are generated when read (any number of users)."""
    src = SyntheticSource(a.synthetic_users, a.synthetic_items, a.synthetic_len)
    items, times = src.column(0), src.column(2)
    seqs = UserSequences(items, src.column(1), times, src.num_items, np.arange(len(src)))
    small = max(len(src), src.num_items) <= IDS_IN_CHECKPOINT
    ids = {"item_ids": list(range(1, src.num_items + 1)), "user_ids": list(range(len(src)))} if small else {}
    return Splits(src.num_items, src.num_events, list(range(len(src))), seqs, LazyItem(items, -2), LazyItem(items, -1),
                  train_items=src.column(0, 0, -2), **ids, weights=_targets(src.lengths - 2, a))


def file_ids(data, seqs: UserSequences) -> dict[str, list]:
    """The data file's ids: ``item_ids`` of items 1..num_items and ``user_ids`` of the sequences ``seqs``."""
    items = data.item_ids if data.item_ids is not None else np.arange(1, data.num_items + 1)
    users = seqs.users if data.user_ids is None else data.user_ids[seqs.users]
    return {"item_ids": items.tolist(), "user_ids": users.tolist()}


def _most_events(data) -> int:
    return int(np.unique(data.user, return_counts=True)[1].max())


def build_item_table(a: argparse.Namespace, num_items: int, world: int, device) -> distributed.ItemTable:
    """The item table of ``--shard-embeddings`` after checking that its state fits every rank (one line naming
    the sizes, before anything is allocated); its rows depend only on ``--seed``."""
    rows = num_items + 1
    free = distributed.free_bytes(device)
    if world > 1:  # every rank decides on the smallest free memory, so all refuse or none
        t = torch.tensor([free], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        free = int(t)
    where = f"{device}" if world == 1 else f"the emptiest of {world} ranks ({device.type})"
    distributed.check_table_memory(rows, a.dim, a.shard_embeddings, world, free, where)
    return distributed.item_table(rows, a.dim, seed=a.seed, sharding=a.shard_embeddings, world=world, device=device)


def retrieval_metrics(model, seqs: UserSequences, inputs_end: int, targets, max_len: int, device,
                      names: tuple[str, ...] = ("hr@10", "ndcg@10"), users=None) -> dict:
    """The metrics ``names`` (``hr@K``, ``ndcg@K``, ``mrr``) by full-corpus ranking of ``users`` (default all);
    inputs are each sequence without its last ``inputs_end`` events. A model whose item table is sharded ranks
    on every rank (all must call this)."""
    if hasattr(model, "eval"):
        model.eval()
    users = range(len(seqs.items)) if users is None else users
    sharded = distributed.is_sharded(model)
    ranks = []
    for s in range(0, len(users), 256):
        chunk = users[s:s + 256]
        items = [x[:len(x) - inputs_end] for x in (seqs.items[u] for u in chunk)]
        times = [x[:len(x) - inputs_end] for x in (seqs.times[u] for u in chunk)]
        tgts = [int(targets[u]) for u in chunk]
        batch = make_batch(items, times, max_len, with_targets=False).to(device)
        if sharded:
            ranks += distributed.sharded_ranks(model, batch, tgts, items)
            continue
        scores = model.scores(batch).float().cpu()
        ranks += [target_rank(scores[r], tgt, torch.from_numpy(hist)) for r, (hist, tgt) in enumerate(zip(items, tgts))]
    return ranks_to_metrics(ranks, list(names))


def ranking_metrics(model, req: RankingRequests, device, names: tuple[str, ...] = ("auc", "ndcg@10"),
                    requests=None) -> dict:
    """Per task: AUC over all candidates, GAUC (AUC per request, weighted by its candidates), NDCG@K within
    each candidate list, as ``names`` asks; over ``requests`` (indices, default all)."""
    if requests is not None:
        req = RankingRequests(*([col[i] for i in requests] for col in (req.hist_items, req.hist_times,
                                                                       req.cand_items, req.labels)))
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for s in range(0, len(req.cand_items), 128):
            b = collate(req, list(range(s, min(s + 128, len(req.cand_items))))).to(device)
            scores.append(model(*b.inputs()).float().cpu().numpy()), labels.append(b.labels.cpu().numpy())
    allsc, alllab = np.concatenate(scores), np.concatenate(labels)
    starts = np.cumsum([0] + [len(c) for c in req.cand_items])
    out = {}
    for metric in names:
        for t, task in enumerate(TASKS):
            sc, lab = allsc[:, t], alllab[:, t]
            if metric == "auc":
                value = auc(sc, lab)
            elif metric == "gauc":
                value = gauc(sc, lab, starts)
            else:
                value = list_ndcg(sc, lab, starts, k=int(metric.split("@")[1]))
            out[f"{metric_key(metric)} {task}"] = value
    return out


def eval_sample(a: argparse.Namespace, n: int) -> list[int] | None:
    """The users (ranking: requests) that ``--eval-users`` keeps, the same in every epoch; None for all."""
    if not a.eval_users or a.eval_users >= n:
        return None
    return np.sort(np.random.default_rng(2**31 + 7).choice(n, size=a.eval_users, replace=False)).tolist()


def evaluate(a: argparse.Namespace, model, d: Splits, split: str, device) -> dict:
    """Metrics on ``split`` ("valid" or "test")."""
    if a.task == "retrieval":
        inputs_end, targets = (2, d.valid) if split == "valid" else (1, d.test)
        return retrieval_metrics(model, d.seqs, inputs_end, targets, a.max_len, device, a.metric_names,
                                 eval_sample(a, len(d.seqs.items)))
    req = d.valid if split == "valid" else d.test
    return ranking_metrics(model, req, device, a.metric_names, eval_sample(a, len(req.cand_items)))


def validation_score(a: argparse.Namespace, record: dict) -> float:
    """What picks the best epoch: NDCG@10 for retrieval, the mean AUC over tasks for ranking."""
    if a.task == "retrieval":
        return record["valid NDCG@10"]
    return float(np.nanmean([record[f"valid AUC {t}"] for t in TASKS]))


def run_popularity(a: argparse.Namespace, d: Splits) -> dict:
    """The popularity baseline needs no training: counts over the training (then training + validation) events."""
    names = a.metric_names
    valid = retrieval_metrics(Popularity(d.train_items, d.num_items), d.seqs, 2, d.valid, a.max_len, "cpu", names)
    pop = Popularity([x[:-1] for x in d.seqs.items], d.num_items)
    return {"valid": valid, "test": retrieval_metrics(pop, d.seqs, 1, d.test, a.max_len, "cpu", names)}


def run_config(a: argparse.Namespace, d: Splits) -> dict:
    """What a checkpoint records of its run: the fixed arguments, the data's size, and --lr / --epochs."""
    return {**{k: getattr(a, k) for k in FIXED_ON_RESUME}, "data_rows": d.data_rows, "num_items": d.num_items,
            "data_digest": d.digest, "lr": a.lr, "epochs": a.epochs}


def resume(a: argparse.Namespace, d: Splits, out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, device,
           rank: int) -> Progress:
    """Weights, optimizer and progress from ``out/checkpoint.pt`` (and the sharded folder it names), after checking
    that this run is the checkpoint's run. A sharded state is read into this run's sharding (any number of ranks)."""
    ckpt = out / "checkpoint.pt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"--resume: expected a checkpoint at {ckpt}, no such file (leave out --resume to "
                                "start a new run)")
    state = checkpoint.load(ckpt, map_location=device)
    checkpoint.require(state, ckpt, "config", "epoch", "history", "best", *(() if "sharded" in state else ("opt",)))
    saved, now = saved_config(state, ckpt), run_config(a, d)
    was = {k: saved[k] for k in (*FIXED_ON_RESUME, "data_rows", "num_items", "data_digest")}
    files = was["data"] not in BUILTIN_DATA and now["data"] not in BUILTIN_DATA
    if files and Path(was["data"]).name == Path(now["data"]).name:
        # The same file name, maybe elsewhere (a moved or copied project; older runs recorded a relative path):
        # the data's contents (data_digest; before it was recorded, the size) decide. The checkpoint then records
        # the new path.
        was["data"] = now["data"]
    if was["data_digest"] is None:  # a checkpoint of an older flexhstu: data_rows and num_items compare
        was["data_digest"] = now["data_digest"]
    if was["model"] != "hstu":  # only hstu has a mask: older runs of other models recorded any --mask given
        was["mask"] = now["mask"]
    label = {"data_rows": "events in the data:", "num_items": "items in the data:"}  # not options: say what they are
    changed = [f"{label.get(k, '--' + k.replace('_', '-'))} {was[k]!r} in the checkpoint, {now[k]!r} now" for k in was
               if was[k] != now[k] and k != "data_digest"]
    if was["data_digest"] != now["data_digest"] and not changed:
        changed = [f"--data {now['data']}: other contents than the run's data (same size; its events or ids differ)"]
    if d.duplicates and was["data_rows"] == now["data_rows"] + d.duplicates:
        changed.append(f"the data file holds {d.duplicates} duplicate events, which this flexhstu drops and the "
                       "run (an older flexhstu) trained on")
    if changed:
        raise ValueError(f"--resume: expected the run of {ckpt}, got a different one: " + "; ".join(changed))
    if "sharded" in state:
        checkpoint.load_sharded(out / state["sharded"], model, opt)
    else:
        checkpoint.load_weights(model, state.get("model"), ckpt)
        try:
            opt.load_state_dict(state["opt"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{ckpt}: the optimizer state does not fit the run's model ({e})") from e
    if a.lr is None:  # not given: the run keeps its learning rate and length
        a.lr = saved["lr"]
    if a.epochs is None:
        a.epochs = saved["epochs"]
    notes = []
    if saved["lr"] != a.lr:
        for group in opt.param_groups:
            group["lr"] = a.lr
        notes.append(f"--lr {a.lr} replaces the checkpoint's {saved['lr']}")
    if saved["epochs"] != a.epochs:
        notes.append(f"--epochs {a.epochs} replaces the checkpoint's {saved['epochs']} ({state['epoch']} done)")
    if rank == 0 and not a.quiet:  # --quiet: nothing but errors
        if state["epoch"] >= a.epochs:  # nothing left to train: the outputs are written again from the checkpoint
            print(f"flexhstu train: all {a.epochs} epochs are done in {ckpt} ({state['epoch']} trained); "
                  "writing the run's outputs again (--epochs N for more)", file=sys.stderr)
        else:
            print(f"flexhstu train: resuming at epoch {state['epoch'] + 1} of {a.epochs} from {ckpt}",
                  file=sys.stderr)
        for note in notes:
            print(f"flexhstu train: resuming: {note}", file=sys.stderr)
    return Progress(state["history"], state["epoch"], state["best"])


def save_checkpoint(a: argparse.Namespace, d: Splits, out: Path, model, opt, p: Progress, new_best: bool,
                    rank: int) -> None:
    """``out/checkpoint.pt`` after an epoch. With ``--shard-embeddings none`` it holds the weights, the optimizer
    and the best epoch's weights (rank 0 writes it). Otherwise every rank writes its shards with
    torch.distributed.checkpoint to ``out/sharded/epoch-N`` (and ``best-N`` at a new best), and ``checkpoint.pt``,
    replaced last, names them; folders it no longer names are then deleted."""
    meta = {"config": run_config(a, d), "history": p.history, "epoch": p.epoch}
    if d.item_ids:
        meta.update(item_ids=d.item_ids, user_ids=d.user_ids)
    if a.shard_embeddings == "none":
        if new_best:
            p.best["model"] = copy.deepcopy(model.state_dict())
        checkpoint.save({**meta, "model": model.state_dict(), "opt": opt.state_dict(), "best": p.best},
                        out / "checkpoint.pt")
        return
    if new_best:
        p.best["dir"] = f"sharded/best-{p.epoch:04d}"
        checkpoint.save_sharded(out / p.best["dir"], model)
    state = f"sharded/epoch-{p.epoch:04d}"
    checkpoint.save_sharded(out / state, model, opt)
    if rank == 0:
        checkpoint.save({**meta, "sharded": state, "best": p.best}, out / "checkpoint.pt")
        checkpoint.remove_unreferenced(out / "sharded", {Path(state).name, Path(p.best.get("dir", "")).name})
    if dist.is_initialized():
        dist.barrier()


class Throughput:
    """Input tokens and seconds of this invocation's training steps, all of them and those after the first
    ``WARMUP_STEPS`` (allocation, kernel compilation); a step is timed from its batch's assembly to its loss
    on the host (``loss.item()`` waits for the device)."""

    def __init__(self):
        self.steps, self.tokens, self.seconds = 0, 0, 0.0
        self.steady_tokens, self.steady_seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        if self.steps > WARMUP_STEPS:
            self.steady_tokens, self.steady_seconds = self.steady_tokens + tokens, self.steady_seconds + seconds

    def report(self, world: int, device: torch.device) -> dict:
        """Totals over the ranks (collective): tokens/s of all ranks together (their tokens over the slowest
        rank's seconds), per rank, and each rank's own; on CUDA each rank's peak allocated memory."""
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        mine = [self.tokens, self.seconds, self.steady_tokens, self.steady_seconds, peak]
        every = [mine] * world
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, mine)

        def rates(tokens, seconds) -> dict:
            total, slowest = sum(tokens), max(seconds)
            rate = total / slowest if slowest > 0 else 0.0
            return {"tokens": total, "seconds": slowest, "tokens_per_s": rate, "tokens_per_s_per_rank": rate / world,
                    "each_rank": [t / s if s > 0 else 0.0 for t, s in zip(tokens, seconds)]}

        out = {"ranks": world, "steps": self.steps, **rates([e[0] for e in every], [e[1] for e in every])}
        if device.type == "cuda":
            out["peak_memory_gb"] = [e[4] / 1e9 for e in every]
        if self.steps > WARMUP_STEPS:
            out["after_warmup"] = {"steps": self.steps - WARMUP_STEPS,
                                   **rates([e[2] for e in every], [e[3] for e in every])}
        return out


def epoch_batches(a: argparse.Namespace, epoch: int, d: Splits) -> tuple[torch.Generator, list[list[int]]]:
    """The epoch's steps, ``--batch-size`` units each in an order drawn by a generator seeded by (seed, epoch);
    the generator then draws the negatives."""
    gen = torch.Generator().manual_seed(a.seed * 1000 + epoch)
    order = torch.randperm(len(d.units), generator=gen).tolist()
    batches = [order[i:i + a.batch_size] for i in range(0, len(order), a.batch_size)]
    return gen, batches[:a.steps_per_epoch] if a.steps_per_epoch else batches


def train_epoch(a: argparse.Namespace, epoch: int, d: Splits, model, ddp, opt, rank: int, world: int,
                device, speed: Throughput) -> dict:
    """One epoch. Rank r trains on every world-th unit of each step, its mean loss weighted by its share of the
    step's targets (ranking: candidates) times the number of ranks, so DDP's mean gradient is the gradient of the
    whole step's mean loss: a retrieval run without dropout trains the same parameters on any number of ranks,
    up to float rounding. A rank left without a unit (a short last step) runs one with weight 0, as its
    collectives need it. The recorded loss is the mean over steps of the whole step's mean loss.

    ``Diverged`` stops it at the first step whose loss is not finite (on one rank at once; on several after the
    epoch, when every rank holds every step's loss, so that all stop together), and after the epoch if its last
    update left a weight that is not finite."""
    torch.manual_seed(a.seed * 1000 + epoch)  # dropout stream of this epoch
    gen, batches = epoch_batches(a, epoch, d)
    sharded = distributed.is_sharded(model)
    model.train()
    t0, tokens, losses = time.perf_counter(), 0, []
    bar = tqdm(batches, desc=f"epoch {epoch + 1}/{a.epochs}", disable=a.quiet or rank != 0, dynamic_ncols=True)
    for step in bar:
        start = time.perf_counter()
        idx = step[rank::world]
        share = float(d.weights[idx].sum()) / max(float(d.weights[step].sum()), 1.0) if idx else 0.0
        idx = idx or step[:1]
        if a.task == "retrieval":
            batch = make_batch([d.train_items[i] for i in idx], [d.seqs.times[i][:-2] for i in idx], a.max_len)
            batch = batch.to(device)
            loss = ddp(batch, a.negatives, gen)  # forward is the sampled-softmax loss
            step_tokens = batch.items.numel()
        else:
            b = collate(d.train_req, idx).to(device)
            loss = onerank_loss(ddp(*b.inputs()), b.labels, b.cand_offsets)
            step_tokens = b.hist_items.numel() + b.cand_items.numel() * model.group_size
        opt.zero_grad(set_to_none=True)
        (loss * (share * world) if world > 1 else loss).backward()
        if sharded:
            distributed.clip_grad_norm_(model.parameters(), 1.0, group=model.encoder.items.group)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item() * share if world > 1 else loss.item())
        if world == 1 and not math.isfinite(losses[-1]):
            bar.close()
            raise Diverged(epoch, len(losses), len(batches), f"the loss became {losses[-1]}")
        step_tokens = step_tokens if share > 0 or world == 1 else 0
        tokens += step_tokens
        speed.add(step_tokens, time.perf_counter() - start)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    if world > 1:  # each rank holds its share of every step's loss
        summed = torch.tensor(losses, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(summed)
        losses = summed.tolist()
        bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
        if bad is not None:
            raise Diverged(epoch, bad + 1, len(batches), f"the loss became {losses[bad]}")
    if not math.isfinite(checksum(model)):  # every rank: a sharded table's sum is collective
        raise Diverged(epoch, len(batches), len(batches), "the weights became non-finite in the update")
    return {"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": time.perf_counter() - t0}


class Diverged(Exception):
    """Training produced a non-finite loss or weight at (0-based) ``epoch``, 1-based ``step`` of ``steps``."""

    def __init__(self, epoch: int, step: int, steps: int, what: str):
        super().__init__(f"{what} at epoch {epoch + 1} step {step} of {steps}")
        self.epoch, self.step, self.steps, self.what = epoch, step, steps, what


def diverged_message(a: argparse.Namespace, e: Diverged, out: Path, p: Progress, knows_progress: bool) -> str:
    """The one line of a run stopped by ``e``: where, the learning rate, and what was kept (nothing of the
    diverged epoch is saved: the checkpoint, metrics.json and metrics.png stay as the last finite epoch left them)."""
    if a.no_checkpoint:
        kept = "nothing was saved (--no-checkpoint)"
    elif not knows_progress:
        kept = f"{out / 'checkpoint.pt'} keeps the last finite epoch, if one finished"
    elif p.epoch:
        kept = (f"{out / 'checkpoint.pt'} keeps epoch {p.epoch}, the last finite one (--resume with a lower --lr "
                "continues from it)")
    else:
        kept = "no checkpoint was written (no epoch finished with finite weights)"
    return f"{e} with --lr {a.lr:g}: training diverged and stopped; {kept}"


def plot_title(a: argparse.Namespace) -> str:
    """Model, mask and data of a run, for its plot."""
    data = Path(a.data).name if a.data not in BUILTIN_DATA else a.data
    if a.model == "onerank":
        mask = "targets mask" if a.no_task_tokens else "task tokens"
    elif a.model == "hstu" and a.mask == "sla":
        mask = f"SLA k1={a.sla_k1} k2={a.sla_k2}"
    else:
        mask = "causal"
    return f"{a.model} ({mask}) on {data}, seed {a.seed}"


def plot(history: list[dict], path: Path, title: str, best_epoch: int | None) -> None:
    """The loss and each validation metric in a grid of at most 4 panels a row; a ranking metric's panel has
    one line per task. The best validation epoch is a dashed line in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels: dict[str, list[tuple[str, str]]] = {}  # panel title -> (line label, history key)
    for key in dict.fromkeys(k for h in history for k in h if k not in ("epoch", "seconds")):
        task = next((t for t in TASKS if key.endswith(f" {t}")), None)
        panels.setdefault(key.removesuffix(f" {task}") if task else key, []).append((task or key, key))
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 2.9 * rows + 0.5), squeeze=False)
    epochs = [h["epoch"] for h in history]
    for ax, (name, lines) in zip(axes.flat, panels.items()):
        for label, key in lines:
            ax.plot(epochs, [h.get(key, math.nan) for h in history], marker="o", markersize=3, label=label)
        if best_epoch is not None:
            ax.axvline(best_epoch, color="0.4", linestyle="--", linewidth=1, label=f"best epoch {best_epoch}")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("epoch", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(lines) > 1 or ax is axes.flat[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    checkpoint.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))  # a kill leaves the old plot
    plt.close(fig)


def json_safe(x):
    """``x`` with every NaN or infinite float as None: JSON has no NaN, and readers (jq, browsers) refuse one."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def written_metrics(out: Path) -> dict:
    """The ``metrics.json`` already in ``out``; {} when there is none (or none that reads as one)."""
    try:
        written = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return written if isinstance(written, dict) else {}


def write(result: dict, history: list[dict], out: Path, rank: int, a: argparse.Namespace) -> dict:
    """metrics.json (and metrics.png when there is a history) in ``out`` on rank 0; returns ``result``."""
    result["history"] = history
    if rank == 0:
        checkpoint.write_text(out / "metrics.json", json.dumps(json_safe(result), indent=1, default=str,
                                                               allow_nan=False))
        latest_after_output(out, rank)
        if history:
            plot(history, out / "metrics.png", plot_title(a), result.get("best_epoch"))
        if not a.quiet:
            print(json.dumps({"test": result.get("test")}))
            if "throughput" in result:
                print(f"flexhstu train: {throughput_line(result['throughput'])}")
            written = ", ".join(f.name for f in sorted(out.iterdir()) if f.is_file() and not f.name.startswith("."))
            best = f"; best epoch {result['best_epoch']} of {len(history)}" if "best_epoch" in result else ""
            print(f"flexhstu train: wrote {out}/ ({written}){best}")
    return result


def throughput_line(t: dict) -> str:
    """The tokens/s report of ``Throughput.report`` in one line."""
    ranks = f"{t['ranks']} rank{'s' * (t['ranks'] > 1)}"
    line = (f"{t['tokens_per_s']:,.0f} tokens/s on {ranks} ({t['tokens_per_s_per_rank']:,.0f} per rank) over "
            f"{t['steps']} steps")
    if "after_warmup" in t:
        w = t["after_warmup"]
        line += (f"; after the first {WARMUP_STEPS} steps {w['tokens_per_s']:,.0f} tokens/s "
                 f"({w['tokens_per_s_per_rank']:,.0f} per rank)")
    return line


def main(argv=None) -> dict:
    """Train and evaluate as ``argv`` says; returns what ``metrics.json`` holds. Input errors raise ``UserError``; a
    run that cannot finish (a non-finite loss, a file that cannot be written) raises ``RunFailure``."""
    return train(parse(argv))


def train(a: argparse.Namespace) -> dict:
    rank, world, created = distributed.setup()
    with user_input():
        device = resolve_device(a, rank)
    with user_input():  # before the run's folder: a data mistake leaves no empty run and runs/latest unmoved
        d = prepare_data(a)
        check_cutoffs(a, d.num_items)
    with user_input("--out"):
        out = resolve_out(a, rank, world)
    try:
        return _train_in(a, out, d, device, rank, world, created)
    finally:
        unlock_run(out)


def _train_in(a: argparse.Namespace, out: Path, d: Splits, device, rank: int, world: int, created: bool) -> dict:
    """The run in its (locked) folder ``out``."""
    torch.manual_seed(a.seed)
    result: dict = {"args": vars(a)}
    if a.model == "popularity":
        with output_files():
            return write(result | run_popularity(a, d), [], out, rank, a)

    with user_input():
        table = build_item_table(a, d.num_items, world, device)
    model = build_model(model_config(a), d.num_items, items=table).to(device)
    collective = table.sharded  # every rank reads a sharded table: all evaluate and save, rank 0 writes
    ddp = model
    if world > 1:
        if collective:  # the table's gradient reaches its owner through the lookup, not through DDP
            DDP._set_params_and_buffers_to_ignore_for_model(model, ["encoder.items.weight"])
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(param_groups(a, model), lr=a.lr if a.lr is not None else DEFAULT_LR, weight_decay=0.01)
    p = Progress()
    if a.resume:
        with user_input():
            p = resume(a, d, out, model, opt, device, rank)
    speed = Throughput()
    last = min(a.epochs, p.epoch + a.stop_after) if a.stop_after else a.epochs
    for epoch in range(p.epoch, last):
        try:
            record = train_epoch(a, epoch, d, model, ddp, opt, rank, world, device, speed)
        except Diverged as e:
            raise RunFailure(diverged_message(a, e, out, p, rank == 0 or collective)) from e
        if rank == 0 or collective:
            record.update({f"valid {k}": v for k, v in evaluate(a, model, d, "valid", device).items()})
            p.history.append(record)
            p.epoch = epoch + 1
            score = validation_score(a, record)
            new_best = score > p.best["score"]
            if new_best:
                p.best = {"score": score, "epoch": epoch + 1, "model": None}
            if not a.no_checkpoint:
                with output_files():
                    save_checkpoint(a, d, out, model, opt, p, new_best, rank)
                    latest_after_output(out, rank)
            if rank == 0 and not a.quiet:
                print(json.dumps(record))
        if world > 1:
            dist.barrier()
    if speed.steps:
        result["throughput"] = speed.report(world, device)
    elif "throughput" in (kept := written_metrics(out)):  # nothing trained here (a finished run's outputs
        result["throughput"] = kept["throughput"]  # written again): the report of the run that trained it stays
    elif world > 1:
        result["throughput"] = speed.report(world, device)
    if (rank == 0 or collective) and len(p.history) >= a.epochs:
        result["test_epoch"] = len(p.history)
        if p.best["epoch"] and not a.no_checkpoint:
            if p.best.get("dir"):
                with user_input():
                    checkpoint.load_sharded(out / p.best["dir"], model)
            elif p.best["model"] is not None:
                model.load_state_dict(p.best["model"])
            result["best_epoch"] = result["test_epoch"] = p.best["epoch"]
        result["test"] = evaluate(a, model, d, "test", device)
    if world > 1:
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checksum": checksum(model)}))
        dist.barrier()
    if created:
        dist.destroy_process_group()
    with output_files():
        return write(result, p.history, out, rank, a)


def param_groups(a: argparse.Namespace, model: torch.nn.Module):
    """AdamW's parameters: one group (``--shard-embeddings none``, as always), else the dense parameters and the
    item table apart (on every number of ranks, so a sharded checkpoint resumes anywhere): a sharded table is a
    DTensor, which torch's multi-tensor kernels do not mix with plain tensors, and its group takes the fused
    kernel, which updates in place where the multi-tensor one would allocate a table-sized temporary."""
    if a.shard_embeddings == "none":
        return model.parameters()
    dense = [q for n, q in model.named_parameters() if n != "encoder.items.weight"]
    return [{"params": dense}, {"params": [model.encoder.items.weight], "fused": True}]


def checksum(model: torch.nn.Module) -> float:
    """The sum of every parameter (a sharded one summed over the ranks): equal on every rank of a healthy run."""
    total = 0.0
    for q in model.parameters():
        if hasattr(q, "to_local") and any(pl.is_shard() for pl in q.placements):
            part = q.to_local().detach().sum(dtype=torch.float64).reshape(1)
            dist.all_reduce(part, group=q.device_mesh.get_group())
            total += float(part)
        else:
            total += float((q.to_local() if hasattr(q, "to_local") else q).detach().sum(dtype=torch.float64))
    return total


def cli(argv=None) -> int:
    """The command: exit status 0; 2 with one line on stderr for an input error; 1 with one line for a run that
    cannot finish (training diverged, a file could not be written)."""
    a = parse(argv)

    def command() -> int:
        train(a)
        return 0

    return run("flexhstu train", command, a.debug)


if __name__ == "__main__":
    sys.exit(cli())
