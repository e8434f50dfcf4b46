"""Seeded synthetic interactions, generated one user at a time.

Users walk a hidden item cycle: the next item is usually ``item + 1`` (planted structure); ratings are 5 on
the cycle and 1-3 off it; time gaps are 1 minute to 1 day. A user's events depend only on ``(seed, user)``,
so a corpus of any size (10^6 users of 4096 events) costs memory only for the users being read: the lengths
of all users (one int64 each) are drawn up front, the events of a user when asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache

import numpy as np

from .._errors import as_int, bad_value

ON_CYCLE = 0.85  # probability that the next item is item + 1


class SyntheticSource:
    """``num_users`` users of ``max(3, length // 2)`` to ``length`` events over items ``1..num_items``."""

    def __init__(self, num_users: int = 300, num_items: int = 200, length: int = 40, seed: int = 0):
        self.num_users = as_int("num_users", num_users, 1)
        self.num_items = as_int("num_items", num_items, 1)
        self.length = as_int("length", length, 3)
        self.seed = as_int("seed", seed)
        low = max(3, self.length // 2)
        self.lengths = np.random.default_rng([self.seed, 2**32]).integers(low, self.length + 1, size=self.num_users)
        self.user = lru_cache(maxsize=512)(self._user)  # a batch's users are read per column

    def __len__(self) -> int:
        return self.num_users

    @property
    def num_events(self) -> int:
        return int(self.lengths.sum())

    def _user(self, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Items (int64, 1-based), ratings (float64) and strictly increasing times (int64) of user ``u``."""
        if not 0 <= u < self.num_users:
            raise bad_value("user", f"an index in [0, {self.num_users})", u)
        rng = np.random.default_rng([self.seed, u])
        n = int(self.lengths[u])
        start = int(rng.integers(self.num_items))
        on = rng.random(n) < ON_CYCLE
        jumps = rng.integers(self.num_items, size=n)
        off_ratings = rng.integers(1, 4, size=n).astype(np.float64)
        times = int(rng.integers(1_000_000)) + np.cumsum(rng.integers(60, 86_400, size=n))
        # item i is (item i-1) + 1 on the cycle, jumps[i] off it: count the steps since the last jump
        i = np.arange(n)
        last_jump = np.maximum.accumulate(np.where(on, -1, i))
        anchor = np.where(last_jump >= 0, jumps[np.maximum(last_jump, 0)], start)
        items = (anchor + i - last_jump) % self.num_items + 1
        return items.astype(np.int64), np.where(on, 5.0, off_ratings), times.astype(np.int64)

    def column(self, which: int, start: int = 0, stop: int | None = None) -> LazyColumn:
        """Column ``which`` (0 items, 1 ratings, 2 times) of every user, each sliced ``[start:stop]``."""
        return LazyColumn(self, which, start, stop)


class LazyColumn(Sequence):
    """A read-only list of one column of each user's events, generated when indexed."""

    def __init__(self, source: SyntheticSource, which: int, start: int = 0, stop: int | None = None):
        self.source, self.which, self.start, self.stop = source, which, start, stop

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self.source.user(int(i))[self.which][self.start : self.stop]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


class LazyItem(Sequence):
    """``column[u][position]`` for every user ``u`` (e.g. the held-out last item), generated when indexed."""

    def __init__(self, column: LazyColumn, position: int):
        self.column, self.position = column, position

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return int(self.column[i][self.position])
