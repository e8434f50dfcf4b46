"""Relative attention bias: the published HSTU's learned bias per relative position and per time-gap bucket.

The bias enters the scores before the SiLU, ``S = alpha * Q K^T + bias(i, j)``, with (per sequence,
local positions ``i`` for the query and ``j`` for the key, sequence length ``L``)::

    bias(i, j) = pos_w[clamp(j - i + P - 1, 0, 2P - 2)] + ts_w[bucket(next_ts(i) - ts(j))]
    next_ts(i) = ts(i + 1) if i + 1 < L else ts(i)      # the query's next event; the last row its own
    bucket(g)  = clamp(floor(ln(max(|g|, 1)) / 0.301), 0, num_buckets)
    g          = next_ts(i) - ts(j) in int64, saturated at +-(2^63 - 1) (``time_gap``)

``pos_w`` has ``2P - 1`` entries (``P`` the longest sequence it was made for); a relative position
beyond the table takes the entry at its nearer end. ``ts_w`` has ``num_buckets + 1`` entries (the last
bucket gathers every gap beyond the others). Either table is shared by the heads (1-D) or one row per
head ``(H, ...)``. The 0.301 divisor is the published model's (a log scale of base ``e^0.301``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._errors import bad_type, bad_value
from ..jagged import lengths_of

# The published model's scale: bucket k holds gaps from e^(0.301 k) to e^(0.301 (k + 1)) time units.
BUCKET_LOG_DIVISOR = 0.301


class RelativeBias(NamedTuple):
    """The tables of a relative attention bias and the event times they read.

    - ``pos_w``: ``(2P - 1,)`` or ``(H, 2P - 1)`` floating, one entry per relative position ``j - i``
      from ``-(P - 1)`` to ``P - 1``.
    - ``ts_w``: ``(num_buckets + 1,)`` or ``(H, num_buckets + 1)`` floating, one entry per time-gap bucket.
    - ``timestamps``: ``(total,)`` integer, each jagged row's event time.
    """

    pos_w: torch.Tensor
    ts_w: torch.Tensor
    timestamps: torch.Tensor

    @property
    def num_buckets(self) -> int:
        return self.ts_w.shape[-1] - 1


_INT64_MAX = torch.iinfo(torch.int64).max


def time_gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` for int64 times, saturated to ``[-(2^63 - 1), 2^63 - 1]`` instead of wrapping: times that span
    2^63 units or more (nonsense, but no check can see it without reading the device) fall in the top
    bucket, as their true gap does, instead of wrapping around to a small one."""
    d = a - b
    wrapped = ((a ^ b) & (a ^ d)) < 0  # a and b of opposite signs, and d of b's sign: the subtraction overflowed
    return torch.where(wrapped, torch.where(a < 0, -_INT64_MAX, _INT64_MAX), d.clamp(min=-_INT64_MAX))


def time_bucket(gap: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``clamp(floor(ln(max(|gap|, 1)) / 0.301), 0, num_buckets)`` as int64, elementwise."""
    # float64: an int64 gap of seconds is exact there, so the bucket edges do not move with rounding.
    log = torch.log(gap.clamp(min=-_INT64_MAX).abs().clamp(min=1).to(torch.float64))
    return torch.floor(log / BUCKET_LOG_DIVISOR).to(torch.int64).clamp(0, num_buckets)


def check_relative_bias(bias: object, q: torch.Tensor) -> None:
    """Raise ``arg: expected X, got Y`` unless ``bias`` is a RelativeBias that fits ``q (total, H, D)``."""
    if not isinstance(bias, RelativeBias):
        raise bad_type("rel_bias", "a flexhstu.ops.bias.RelativeBias(pos_w, ts_w, timestamps)", type(bias).__name__)
    total, nheads, _ = q.shape
    for name, w in (("rel_bias.pos_w", bias.pos_w), ("rel_bias.ts_w", bias.ts_w)):
        if not isinstance(w, torch.Tensor):
            raise bad_type(name, "a torch.Tensor", type(w).__name__)
        if not w.dtype.is_floating_point:
            raise bad_type(name, "a floating dtype", w.dtype)
        if w.device != q.device:
            raise bad_value(f"{name}.device", f"the device of q ({q.device})", w.device)
        if not (w.dim() == 1 or (w.dim() == 2 and w.shape[0] in (1, nheads))):
            raise bad_value(name, f"shape (n,) shared by the heads or (H={nheads}, n)", f"shape {tuple(w.shape)}")
    if bias.pos_w.shape[-1] % 2 != 1:
        raise bad_value("rel_bias.pos_w", "an odd number 2P - 1 of relative positions", bias.pos_w.shape[-1])
    if bias.ts_w.shape[-1] < 1:
        raise bad_value("rel_bias.ts_w", "num_buckets + 1 >= 1 entries", bias.ts_w.shape[-1])
    ts = bias.timestamps
    if not isinstance(ts, torch.Tensor):
        raise bad_type("rel_bias.timestamps", "a torch.Tensor", type(ts).__name__)
    if ts.dtype.is_floating_point or ts.dtype.is_complex or ts.dtype == torch.bool:
        raise bad_type("rel_bias.timestamps", "an integer dtype", ts.dtype)
    if tuple(ts.shape) != (total,):
        raise bad_value("rel_bias.timestamps", f"one time per jagged row ({total},)", f"shape {tuple(ts.shape)}")
    if ts.device != q.device:
        raise bad_value("rel_bias.timestamps.device", f"the device of q ({q.device})", ts.device)


def check_rab(rab: object, q: torch.Tensor, batch: int, max_seq_len: int) -> None:
    """Raise unless ``rab`` is a floating ``(B, N, N)`` or ``(B, 1 or H, N, N)`` tensor, ``N = max_seq_len``."""
    if not isinstance(rab, torch.Tensor):
        raise bad_type("rab", "a torch.Tensor (B, [H,] N, N)", type(rab).__name__)
    if not rab.dtype.is_floating_point:
        raise bad_type("rab", "a floating dtype", rab.dtype)
    if rab.device != q.device:
        raise bad_value("rab.device", f"the device of q ({q.device})", rab.device)
    n, nheads = max_seq_len, q.shape[1]
    fits = rab.dim() in (3, 4) and rab.shape[0] == batch and tuple(rab.shape[-2:]) == (n, n)
    if not fits or (rab.dim() == 4 and rab.shape[1] not in (1, nheads)):
        expected = f"shape (B={batch}, N, N) or (B, 1 or H={nheads}, N, N) with N = max_seq_len = {n}"
        raise bad_value("rab", expected, f"shape {tuple(rab.shape)}")


def dense_relative_bias(bias: RelativeBias, seq_offsets: torch.Tensor, n: int) -> torch.Tensor:
    """The bias of every (query, key) pair, padded: ``(B, Hb, n, n)``, float32 (float64 for float64 tables).

    ``Hb`` is 1 when both tables are shared, else H. Rows and columns past a sequence's end hold
    values of no meaning (the caller masks them); ``n`` is at least every length; ``total >= 1``.
    """
    offs = seq_offsets.to(torch.int64)
    lengths = lengths_of(offs)
    pos = torch.arange(n, device=offs.device)
    last = bias.timestamps.shape[0] - 1
    rows = (offs[:-1, None] + pos[None, :]).clamp(0, last)  # (B, n): the jagged row of each slot
    ts = bias.timestamps.to(torch.int64)
    has_next = (pos[None, :] + 1) < lengths[:, None]
    next_ts = torch.where(has_next, ts[(rows + 1).clamp(max=last)], ts[rows])
    bucket = time_bucket(time_gap(next_ts[:, :, None], ts[rows][:, None, :]), bias.num_buckets)  # (B, n, n)
    half = (bias.pos_w.shape[-1] - 1) // 2  # P - 1
    rel = (pos[None, :] - pos[:, None] + half).clamp(0, 2 * half)  # (n, n): j - i + P - 1
    # Summed in float32 at least, as the kernels do (half tables would round the sum of two entries).
    dtype = torch.promote_types(torch.promote_types(bias.pos_w.dtype, bias.ts_w.dtype), torch.float32)
    pos_w, ts_w = ((w if w.dim() == 2 else w[None]).to(dtype) for w in (bias.pos_w, bias.ts_w))  # (1 or H, ...)
    return pos_w[:, rel][None] + ts_w[:, bucket].transpose(0, 1)
