"""The data of a run (``Splits``, made by ``prepare_data``): retrieval's leave-one-out split (last event test,
second-to-last validation) or ranking's request sets, with the data file's ids and each unit's loss weight."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

from ..data import data_digest, load, synthetic
from ..data.sequences import UserSequences, leave_one_out, user_sequences
from ..data.synthetic_source import LazyItem, SyntheticSource
from ..models import make_requests
from ..models.ranking import RankingRequests, min_events

IDS_IN_CHECKPOINT = 1 << 20  # a synthetic run records its ids (1..n) for `recommend` up to this many


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
            raise ValueError(
                f"--data {a.data}: expected a user with 3 or more events (one to train on, one to "
                f"validate, one to test), got none; most events of a user: {_most_events(data)}"
            )
        train_items = [x[:-2] for x in seqs.items]
        return Splits(
            data.num_items,
            len(data),
            list(range(len(seqs.items))),
            seqs,
            valid,
            test,
            train_items=train_items,
            **ids,
            weights=_targets(np.array([len(x) for x in train_items]), a),
        )
    seqs = user_sequences(data)
    train_req = make_requests(seqs, "train", max_len=a.max_len, seed=a.seed)
    valid_req = make_requests(seqs, "valid", max_len=a.max_len, seed=a.seed + 1)
    test_req = make_requests(seqs, "test", max_len=a.max_len, seed=a.seed + 2)
    if not train_req.cand_items:
        raise ValueError(
            f"--data {a.data}: ranking expected a user with {min_events()} or more events (and as many "
            f"unseen items as negatives), got none; most events of a user: {_most_events(data)}"
        )
    return Splits(
        data.num_items,
        len(data),
        list(range(len(train_req.cand_items))),
        seqs,
        valid_req,
        test_req,
        train_req=train_req,
        **ids,
        weights=np.array([len(c) for c in train_req.cand_items]),
    )


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
    return Splits(
        src.num_items,
        src.num_events,
        list(range(len(src))),
        seqs,
        LazyItem(items, -2),
        LazyItem(items, -1),
        train_items=src.column(0, 0, -2),
        **ids,
        weights=_targets(src.lengths - 2, a),
    )


def file_ids(data, seqs: UserSequences) -> dict[str, list]:
    """The data file's ids: ``item_ids`` of items 1..num_items and ``user_ids`` of the sequences ``seqs``."""
    items = data.item_ids if data.item_ids is not None else np.arange(1, data.num_items + 1)
    users = seqs.users if data.user_ids is None else data.user_ids[seqs.users]
    return {"item_ids": items.tolist(), "user_ids": users.tolist()}


def _most_events(data) -> int:
    return int(np.unique(data.user, return_counts=True)[1].max())
