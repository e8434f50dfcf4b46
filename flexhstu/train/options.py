"""``flexhstu train``'s options: the parser (every option with a sentence and its default), ``parse`` with the
checks between options, the model settings they make (``model_config``, the one conversion to ``ModelConfig``)
and the check of the metrics' cut-offs against the catalogue."""

from __future__ import annotations

import argparse
import math
import os

import torch

from .. import distributed
from ..cli.common import Parser, non_negative_int, positive_int, seed_int
from ..data.movielens import parse_columns
from ..metrics import parse_metrics
from ..models import ModelConfig
from ..run_settings import FIXED_ON_RESUME, SYNTHETIC_DEFAULTS

BUILTIN_DATA = ("ml-100k", "synthetic")

DEFAULT_LR = 3e-3


def data_path(data: str) -> str:
    """``--data`` as a run records it: a file as an absolute path (``--resume`` and ``flexhstu recommend`` read it
    again from any directory; a relative one would name another file there), a built-in name as given."""
    return data if data in BUILTIN_DATA else os.path.abspath(data)


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
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 3 (one event to train on, one to validate, one to test), got {value}"
        )
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return value


def build_parser() -> Parser:
    """The ``flexhstu train`` parser: every option with a sentence (and its default in ``--help``)."""
    p = Parser(
        prog="flexhstu train",
        description="Train and evaluate a model (under torchrun: python -m flexhstu.train, one shard per rank).",
    )
    p.add_argument(
        "--task",
        choices=["retrieval", "ranking"],
        default="retrieval",
        help="next-item retrieval, or multi-task ranking of candidate lists",
    )
    p.add_argument(
        "--model",
        choices=["hstu", "onerank", "sasrec", "popularity"],
        default="hstu",
        help="hstu, sasrec (softmax baseline) or popularity for retrieval; onerank for ranking",
    )
    p.add_argument(
        "--data",
        default="ml-100k",
        help="ml-100k, synthetic, a ratings.dat / ratings.csv / .parquet path, or any CSV / Parquet file "
        "of interactions with --columns",
    )
    p.add_argument(
        "--synthetic-users",
        type=positive_int,
        default=None,
        help=f"users of --data synthetic (not given: {SYNTHETIC_DEFAULTS['synthetic_users']}); each user's "
        "events are generated when read, so 10^6 users cost only their lengths in memory",
    )
    p.add_argument(
        "--synthetic-items",
        type=positive_int,
        default=None,
        help=f"items of --data synthetic (not given: {SYNTHETIC_DEFAULTS['synthetic_items']})",
    )
    p.add_argument(
        "--synthetic-len",
        type=_at_least_3,
        default=None,
        help=f"most events of a user of --data synthetic (not given: "
        f"{SYNTHETIC_DEFAULTS['synthetic_len']}); lengths are uniform from half of it",
    )
    p.add_argument(
        "--columns",
        type=_columns,
        default=None,
        help="the --data file's column names, e.g. user=uid,item=iid,time=ts,rating=r (rating is "
        "optional: 1.0 for every event without it); ids may be integers or strings, time integers",
    )
    p.add_argument("--mask", choices=["causal", "sla"], default="causal", help="hstu's attention mask")
    p.add_argument("--sla-k1", type=positive_int, default=32, help="sla: local causal window K1")
    p.add_argument("--sla-k2", type=non_negative_int, default=4, help="sla: global prefix K2")
    p.add_argument(
        "--no-rel-bias",
        action="store_true",
        help="hstu ablation: no relative attention bias (per relative position and time-gap bucket)",
    )
    p.add_argument(
        "--no-task-tokens", action="store_true", help="ranking ablation: plain target tokens, fixed targets mask"
    )
    p.add_argument(
        "--epochs",
        type=positive_int,
        default=None,
        help="default: 60 for retrieval, 4 for ranking; on --resume, a new value extends (or ends) the run",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        help="sequences (or requests) per step, split across the ranks under torchrun",
    )
    p.add_argument(
        "--steps-per-epoch",
        type=non_negative_int,
        default=0,
        help="train on the first N batches of each epoch's order only (0: all)",
    )
    p.add_argument("--dim", type=positive_int, default=64, help="model width")
    p.add_argument("--layers", type=positive_int, default=2, help="attention layers")
    p.add_argument("--heads", type=positive_int, default=2, help="must divide --dim")
    p.add_argument("--max-len", type=positive_int, default=100, help="the last events of a history that are used")
    p.add_argument("--dropout", type=_probability, default=0.2, help="dropout rate of embeddings and layers")
    p.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help=f"learning rate (default {DEFAULT_LR:g}); on --resume, the checkpoint's unless given",
    )
    p.add_argument(
        "--negatives",
        type=positive_int,
        default=256,
        help="retrieval: sampled negatives per step of the sampled softmax",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the weights, the order and the negatives")
    p.add_argument(
        "--eval-users",
        type=non_negative_int,
        default=0,
        help="validate and test on a fixed random sample of N users (ranking: requests); 0: all",
    )
    p.add_argument(
        "--shard-embeddings",
        choices=distributed.SHARDING,
        default="none",
        help="under torchrun, the item table: whole on every rank (none), split by rows (rowwise: a "
        "DTensor; no rank ever holds more than its rows) or FSDP2's fully_shard (fsdp: sharded "
        "between steps, gathered whole for each step). Sharded runs save torch.distributed."
        "checkpoint folders, resumable on any number of ranks",
    )
    p.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="write no checkpoint (benchmarks); the test metrics are then the last epoch's",
    )
    p.add_argument(
        "--out",
        default=None,
        help="the run's folder, not a filesystem root or the home folder itself (default: a new "
        "runs/<date>-<time>-<model>-<mask>, and runs/latest points to it; with --resume: runs/latest)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/checkpoint.pt (which must exist). Refused if any of "
        + ", ".join("--" + k.replace("_", "-") for k in FIXED_ON_RESUME)
        + " or the data file's contents differ from the checkpoint's run; --lr and --epochs may "
        "change (reported on stderr); --out, --device, --stop-after, --no-checkpoint, --quiet, "
        "--debug and the number of ranks are free",
    )
    p.add_argument(
        "--stop-after", type=non_negative_int, default=0, help="stop after this many epochs of this invocation (tests)"
    )
    p.add_argument(
        "--metrics",
        default=None,
        help="extra evaluation metrics, comma-separated: hr@K, ndcg@K, mrr for retrieval; auc, gauc, "
        "ndcg@K for ranking (e.g. hr@50,ndcg@200,mrr). HR@10 and NDCG@10 (retrieval) or AUC and "
        "NDCG@10 per task (ranking) are always reported",
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device (cuda when available)"
    )
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
        p.error(f"--mask: expected causal (the default) for --model {a.model}, which has no mask choice, got {a.mask}")
    if a.no_task_tokens and a.model != "onerank":
        p.error(f"--no-task-tokens: expected --task ranking --model onerank, got --model {a.model}")
    if a.model == "popularity" and a.shard_embeddings != "none":
        p.error(
            f"--shard-embeddings: expected none for --model popularity (it has no item table), got {a.shard_embeddings}"
        )
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
        arg = (
            "--metrics"
            if a.metrics and name in a.metrics.lower()
            else "--synthetic-items"
            if a.data == "synthetic"
            else "--data"
        )
        raise ValueError(
            f"{arg}: expected a catalogue of more than {k} items for {name} (every item ranks in the "
            f"top {k} of {num_items}: the metric would be 1 whatever the model), got {num_items} items"
        )
