"""A per-user cache of the STU stack's history keys and values (docs/design.md, section 8).

In an STU layer, a new row's attention needs the earlier rows' K and V only (its
own q, k, v, u come from its input), so K and V per layer are all a history
leaves behind. The cache holds them per user, computed once
(:func:`flexhstu.serving.prefill`), appended to when the history grows
(:func:`flexhstu.serving.extend`) and evicted by the caller; :meth:`gather`
lays a request's users out jagged for ``delta_hstu_mha``.

Cached values depend on the attention scale of every layer before them, so a
cache has one ``max_seq_len`` (the bound and the default scale of every call
that fills or reads it); scores from the cache equal a full recompute run with
that same ``max_seq_len``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .._errors import as_int, bad_type, bad_value
from ..ops.fp8 import quantize_fp8


@dataclass
class UserHistory:
    """One user's cached history: per layer ``k (L, H, Dqk)`` and ``v (L, H, Dv)``; ``last (D,)`` is the
    stack's output at the last history row (None for an empty history)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    last: torch.Tensor | None

    @property
    def length(self) -> int:
        return self.k[0].shape[0]


@dataclass
class JaggedHistory:
    """A request's histories, jagged: per layer ``k (T_h, H, Dqk)``, ``v (T_h, H, Dv)``; ``offsets (B + 1,)``
    int64 on the data's device; ``lengths`` the same as host ints (the request plan reads them).

    With ``room > 0`` every history is followed by ``room`` spare rows in ``k`` and ``v`` (``(T_h + B room, H,
    D)``, or more rows for a kept buffer, ``GraphPool``'s, whose last rows are unused): user ``b``'s history
    starts at row ``offsets[b] + b room``. The delta stack writes each micro-batch's
    new rows there, so no call copies the histories again (``stack_delta``).

    ``k_scale``, ``v_scale``: per layer float32 ``(rows, H)``, the scales of e4m3 ``k`` and ``v``
    (``quantize_history``); None for K and V in the model's dtype."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    offsets: torch.Tensor
    lengths: list[int]
    room: int = 0
    k_scale: list[torch.Tensor] | None = None
    v_scale: list[torch.Tensor] | None = None

    @property
    def fp8(self) -> bool:
        """Whether K and V are e4m3 with per-row scales (``quantize_history``)."""
        return self.k_scale is not None


def quantize_history(history: JaggedHistory, into: JaggedHistory | None = None) -> JaggedHistory:
    """The history with every layer's K and V in e4m3 and per-(row, head) scales (``flexhstu.quantize_fp8``), for
    ``stack_delta``'s e4m3 attention. One pass over the history per layer, paid once per request: every
    micro-batch then reads half the bytes. The room's rows (zeros) stay zeros.

    ``into``: an e4m3 history of the same rows (``GraphPool``'s kept buffers) that receives the values and scales
    in place instead of new tensors; the result shares its tensors and ``history``'s offsets."""
    if history.fp8:
        return history
    (k, ks), (v, vs) = (zip(*(quantize_fp8(t) for t in parts)) for parts in (history.k, history.v))
    if into is not None:
        mine = (k, v, ks, vs)
        theirs = (into.k, into.v, into.k_scale, into.v_scale)
        if not into.fp8 or any(
            a.shape != b.shape or a.dtype != b.dtype for x, y in zip(mine, theirs) for a, b in zip(x, y)
        ):
            raise bad_value(
                "into",
                "an e4m3 history of the same rows, heads and dims (quantize_history)",
                "a history of another kind or shape",
            )
        for x, y in zip(mine, theirs):
            for a, b in zip(x, y):
                b.copy_(a)
        k, v, ks, vs = theirs
    return JaggedHistory(list(k), list(v), history.offsets, history.lengths, history.room, list(ks), list(vs))


class HistoryCache:
    """Cached K and V of ``num_layers`` STU layers for many users, keyed by any hashable user id.

    ``max_seq_len``: the length bound and attention scale of every call that fills
    or reads the cache (a history plus the candidates scored against it must fit).
    """

    def __init__(self, num_layers: int, max_seq_len: int):
        self.num_layers = as_int("num_layers", num_layers, minimum=1)
        self.max_seq_len = as_int("max_seq_len", max_seq_len, minimum=1)
        self._users: dict[Hashable, UserHistory] = {}

    def __contains__(self, user: Hashable) -> bool:
        return user in self._users

    def __len__(self) -> int:
        return len(self._users)

    def entry(self, user: Hashable) -> UserHistory:
        """``user``'s cached history (the stored tensors: read them, do not write them)."""
        return self._entry(user)

    def length(self, user: Hashable) -> int:
        """Cached history rows of ``user``."""
        return self._entry(user).length

    def put(self, user: Hashable, entry: UserHistory) -> None:
        """Store (or replace) ``user``'s history (checked: an entry that does not fit the others would fail
        later, in ``gather`` for another request)."""
        # Checked against another user's entry: the one replaced here may differ (a new model's cache).
        self._check_entry(entry, next((e for u, e in self._users.items() if u != user), None))
        if entry.length > self.max_seq_len:
            raise bad_value("entry", f"a history of at most max_seq_len={self.max_seq_len} rows", entry.length)
        self._users[user] = entry

    def append(self, user: Hashable, entry: UserHistory) -> None:
        """Append rows (``entry``: the new rows' K and V per layer, and their last output) to ``user``'s history."""
        old = self._entry(user)
        self._check_entry(entry, old)
        k = [torch.cat([a, b]) for a, b in zip(old.k, entry.k)]
        v = [torch.cat([a, b]) for a, b in zip(old.v, entry.v)]
        self.put(user, UserHistory(k, v, entry.last if entry.length else old.last))

    def evict(self, user: Hashable) -> None:
        """Forget ``user`` (the caller decides when: a cache never evicts by itself)."""
        self._entry(user)
        del self._users[user]

    def last(self, users: Sequence[Hashable]) -> list[torch.Tensor | None]:
        """Each user's stack output at its last history row (None where the history is empty)."""
        return [self._entry(u).last for u in users]

    def gather(self, users: Sequence[Hashable], room: int = 0, into: JaggedHistory | None = None) -> JaggedHistory:
        """The users' histories, jagged in the order given (one copy per layer), each followed by ``room``
        spare rows (``JaggedHistory``: candidate scoring writes its micro-batches there).

        ``into``: a kept history (``GraphPool``'s) whose buffers and offsets receive the histories instead of new
        ones: its ``room`` and user count must be these, its buffers long enough; the rows past the last user's
        room are left as they are. The result shares its tensors."""
        room = as_int("room", room, minimum=0)
        entries = [self._entry(u) for u in users]
        if not entries:
            raise bad_value("users", "at least one cached user", "an empty list")
        lengths = [e.length for e in entries]
        device = entries[0].k[0].device
        host_offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        if into is not None:
            return self._gather_into(entries, lengths, host_offsets, room, into)
        offsets = host_offsets.to(device)

        def laid_out(parts: list[torch.Tensor]) -> torch.Tensor:
            if not room:
                return torch.cat(parts)
            spare = parts[0].new_zeros(room, *parts[0].shape[1:])
            return torch.cat([x for part in parts for x in (part, spare)])

        k = [laid_out([e.k[layer] for e in entries]) for layer in range(self.num_layers)]
        v = [laid_out([e.v[layer] for e in entries]) for layer in range(self.num_layers)]
        return JaggedHistory(k, v, offsets, lengths, room)

    def _gather_into(
        self, entries: list[UserHistory], lengths: list[int], host_offsets: torch.Tensor, room: int, into: JaggedHistory
    ) -> JaggedHistory:
        need = sum(lengths) + room * len(lengths)
        if into.room != room or into.offsets.shape[0] != len(lengths) + 1 or into.k[0].shape[0] < need:
            raise bad_value(
                "into",
                f"a history of {len(lengths)} users with room {room} and at least {need} rows",
                f"{into.offsets.shape[0] - 1} users, room {into.room}, {into.k[0].shape[0]} rows",
            )
        ref = entries[0]
        for name in ("k", "v"):  # copy_ would cast a dtype silently
            want = [(t.shape[1:], t.dtype, t.device) for t in getattr(ref, name)]
            got = [(t.shape[1:], t.dtype, t.device) for t in getattr(into, name)]
            if want != got:
                raise bad_value(f"into.{name}", f"per layer (rows, heads, dim), dtype and device {want}", got)
        for layer in range(self.num_layers):
            for bufs, name in ((into.k, "k"), (into.v, "v")):
                start = 0
                for e, n in zip(entries, lengths):
                    bufs[layer][start : start + n].copy_(getattr(e, name)[layer])
                    start += n + room
        into.offsets.copy_(host_offsets)
        return JaggedHistory(into.k, into.v, into.offsets, lengths, room)

    def _check_entry(self, entry: UserHistory, like: UserHistory | None) -> None:
        """Per layer ``k (L, H, Dqk)`` and ``v (L, H, Dv)`` of one length ``L``, shaped, typed and placed like
        ``like`` (an entry cached already); ``last`` a ``(D,)`` tensor, None only for an empty history."""
        if not isinstance(entry, UserHistory):
            raise bad_type("entry", "a flexhstu.serving.UserHistory", type(entry).__name__)
        if len(entry.k) != self.num_layers or len(entry.v) != self.num_layers:
            raise bad_value("entry", f"K and V for {self.num_layers} layers", f"{len(entry.k)} and {len(entry.v)}")
        rows = None
        for name, parts in (("k", entry.k), ("v", entry.v)):
            for layer, t in enumerate(parts):
                arg = f"entry.{name}[{layer}]"
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise bad_value(arg, "a (rows, heads, dim) tensor", got)
                rows = t.shape[0] if rows is None else rows
                if t.shape[0] != rows:
                    raise bad_value(
                        arg, f"{rows} rows (as entry.k[0]: one length for every layer's K and V)", t.shape[0]
                    )
                if like is not None:
                    ref = getattr(like, name)[layer]
                    if t.shape[1:] != ref.shape[1:] or t.dtype != ref.dtype or t.device != ref.device:
                        raise bad_value(
                            arg,
                            f"(rows, {', '.join(map(str, ref.shape[1:]))}) {ref.dtype} on "
                            f"{ref.device}, like the cached users'",
                            f"{tuple(t.shape)} {t.dtype} on {t.device}",
                        )
        for layer, (k, v) in enumerate(zip(entry.k, entry.v)):
            if k.shape[1] != v.shape[1]:
                raise bad_value(f"entry.v[{layer}]", f"{k.shape[1]} heads (as entry.k[{layer}])", v.shape[1])
        if entry.last is None and rows:
            raise bad_value(
                "entry.last", "the stack's output at the last history row (None only for an empty history)", None
            )
        if entry.last is not None and (not isinstance(entry.last, torch.Tensor) or entry.last.dim() != 1):
            got = f"shape {tuple(entry.last.shape)}" if isinstance(entry.last, torch.Tensor) else entry.last
            raise bad_value("entry.last", "a (D,) tensor", got)

    def _entry(self, user: Hashable) -> UserHistory:
        if user not in self._users:
            raise KeyError(f"user: expected a cached user (call flexhstu.serving.prefill first), got {user!r}")
        return self._users[user]
