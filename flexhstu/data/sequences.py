"""Per-user chronological sequences and the leave-one-out split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .movielens import Interactions


@dataclass
class UserSequences:
    """Chronological items, ratings and timestamps of each user (users with >= 3 events); ``users[s]`` is the
    ``Interactions.user`` value of sequence ``s``."""

    items: list[np.ndarray]
    ratings: list[np.ndarray]
    times: list[np.ndarray]
    num_items: int
    users: np.ndarray


def user_sequences(data: Interactions, min_len: int = 3) -> UserSequences:
    order = np.lexsort((data.timestamp, data.user))
    user, item, rating, ts = data.user[order], data.item[order], data.rating[order], data.timestamp[order]
    bounds = np.flatnonzero(np.diff(user)) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(user)]])
    keep = [(s, e) for s, e in zip(starts, ends) if e - s >= min_len]
    return UserSequences(
        [item[s:e] for s, e in keep],
        [rating[s:e] for s, e in keep],
        [ts[s:e] for s, e in keep],
        data.num_items,
        np.array([user[s] for s, _ in keep], dtype=np.int64),
    )


def leave_one_out(data: Interactions) -> tuple[UserSequences, list[int], list[int]]:
    """Sequences with the last two events held out: (train sequences, validation item, test item) per user.

    Validation predicts item ``L-2`` from the first ``L-2``; test predicts ``L-1`` from the first ``L-1``.
    """
    seqs = user_sequences(data)
    return seqs, [int(s[-2]) for s in seqs.items], [int(s[-1]) for s in seqs.items]
