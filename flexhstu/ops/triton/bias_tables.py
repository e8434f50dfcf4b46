"""The relative attention bias's tables for the Triton kernels, and the table gradients folded back.

Plain torch code; the kernels' per-tile reads and gradients are ``bias_tiles``. The rule is
``flexhstu.ops.bias`` (docs/design.md, section 4)::

    bias(i, j) = pos_w[clamp(j - i + P - 1, 0, 2P - 2)] + ts_w[bucket(next_ts(i) - ts(j))]

What ``prepare`` makes once per call, on the device, with torch ops (no host read):

* the **position table**, float32, padded on both sides with copies of its end entries so that every
  relative position a tile can hold (``|j - i| < total + 256``, the longest sequence plus a block) has
  its own slot: the kernels index it with ``center + j - i`` and never clamp. ``O(total + P)`` per row
  of the table. Its gradient buffer has the same shape; ``fold_position_grad`` adds the padding's
  gradient into the end entries (what the clamp of the rule does);
* the **time-bucket table**, float32, and its gradient buffer;
* per jagged row, its event time and its next event time as int32 offsets from the earliest of the
  row's *chunk* (its sequence's rows ``256 c .. 256 c + 255``), and that chunk minimum, counted from the
  sequence's earliest time, as float64 (its ``base``: exact below ``BASE_SPAN`` whatever the absolute
  times, nanoseconds since 1970 included). Every tile's rows lie in one chunk and so do its keys (blocks
  are powers of two up to ``CHUNK``), so a tile reads int32 vectors and two scalar bases:
  ``gap = a - b + D`` with ``D = base_rows - base_keys``, exact while a chunk spans less than
  ``2^31 - 1`` time units (68 years in seconds, 24.8 days in milliseconds). int32 keeps a tile's per-key
  time vector at 16 registers where float64 needs 32, which the dK/dV kernel (k, v and both accumulators
  held throughout) cannot spare. A *wide* chunk (a larger span, or a minimum ``BASE_SPAN`` or more after
  its sequence's start) gets the base NaN, found on the device without a host read; a tile whose ``D``
  is NaN takes the exact path of ``bias_tiles._wide_times`` / ``_wide_far`` (int64 times, compared per
  pair with per-row int64 thresholds that never wrap) instead, so any int64 times give the reference's
  buckets (whose gaps saturate at ``2^63 - 1``: ``flexhstu.ops.bias.time_gap``);
* the **bucket edges** (``bucket_edges``): ``E[k]``, the smallest integer gap whose bucket is at least
  ``k``, found on the host with the reference's own float64 formula (``flexhstu.ops.bias.time_bucket``)
  and cached per ``num_buckets`` and device, as float64 and as int32 (saturated). ``bucket(g)`` is then
  the number of edges ``<= |g|``: exact comparisons, equal to the reference for every integer gap
  (edges above ``2^53`` are held rounded, as the reference's float64 log sees those gaps).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...jagged import row_coords
from ..bias import RelativeBias, time_bucket
from .bias_prepare import chunked_times_triton

POS_SLACK = 256
"""Relative positions beyond the longest sequence that a tile can hold: at least the largest block size."""

INT32_SPAN = 2**31 - 1
"""A chunk's times must span less than this (``max - min < INT32_SPAN``) for its int32 offsets to be exact."""
CHUNK = 256
"""Rows per chunk of a sequence: a multiple of every block size, so no tile crosses a chunk."""

_EDGES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, int]] = {}


def bucket_edges(num_buckets: int) -> list[float]:
    """``[-1, E_1, ..., E_nb, inf]``: ``E_k`` the smallest non-negative integer gap with ``time_bucket >= k``
    (``inf`` when no int64 gap reaches bucket ``k``), computed with the reference's float64 formula.

    ``bucket(g)`` = the number of ``k >= 1`` with ``E_k <= |g|`` equals ``time_bucket(g)`` for every integer
    gap: the formula is non-decreasing in ``|g|`` and each edge is checked against its neighbours.
    """
    k = torch.arange(1, num_buckets + 1, dtype=torch.int64)
    top = 2**63 - 1  # the largest gap (time_gap saturates there): no int64 gap reaches a bucket above its own
    reached = time_bucket(torch.full_like(k, top), num_buckets) >= k
    # Binary search, all buckets at once: time_bucket(lo) < k <= time_bucket(hi).
    lo, hi = torch.zeros_like(k), torch.full_like(k, top)
    for _ in range(63):
        mid = lo + (hi - lo) // 2
        up = time_bucket(mid, num_buckets) >= k
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    if not bool(((hi - lo <= 1) | ~reached).all()):
        raise AssertionError("bucket_edges: the binary search did not converge")  # never seen
    return [-1.0, *(float(e) if ok else math.inf for e, ok in zip(hi.tolist(), reached.tolist())), math.inf]


def edges_tensors(num_buckets: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``bucket_edges`` as float64 and as int32 (saturated at ``2^31 - 1``) device tensors ``(num_buckets + 2,)``,
    and the highest bucket an int64 gap reaches (the number of finite edges), made once per (num_buckets,
    device). The first call for a device copies from the host: make it before capturing a CUDA graph."""
    key = (num_buckets, torch.device(device))
    if key not in _EDGES:
        values = bucket_edges(num_buckets)
        edges = torch.tensor(values, dtype=torch.float64)
        edges32 = edges.clamp(max=INT32_SPAN).to(torch.int32)
        _EDGES[key] = (edges.to(device), edges32.to(device), sum(math.isfinite(e) for e in values[1:-1]))
    return _EDGES[key]


class Bias(NamedTuple):
    """What the kernels read (a tuple argument, field by field). ``pos`` / ``ts``: float32 ``(Hb, n)`` tables
    (``*_stride_h`` 0 when shared by the heads); ``pos_center``: the slot of relative position 0;
    ``max_bucket``: the highest bucket an int64 gap
    reaches; ``edges`` / ``edges32``: ``(num_buckets + 2,)`` float64 / int32; ``time32`` / ``next32``: int32
    ``(total,)`` offsets of each row's time and next time from ``time_base`` / ``next_base``, float64
    ``(total,)``, their chunk's minimum, or NaN for a *wide* chunk (one whose times span ``INT32_SPAN`` or
    more: its offsets are saturated and unused); ``time64`` / ``next64``: the int64 times themselves, read
    by tiles that touch a wide chunk; ``seq_wide``: int32 ``(B,)``, 1 for a sequence with a wide chunk (its
    programs run a walk that holds the int64 path, the others one without it: ``add_bias``); ``summary``: int32
    ``(chunks, SUMMARY_SLOTS, 4)``, per chunk and aligned block the min and minus the max of ``time32`` and ``next32``
    (``block_summaries``), so that a tile bounds its gaps from four scalars; ``dpos`` /
    ``dts``: float32 gradient buffers shaped like ``pos`` / ``ts`` (zeros; written by the dK/dV kernel) or
    empty."""

    pos: torch.Tensor
    pos_stride_h: int
    pos_center: int
    ts: torch.Tensor
    ts_stride_h: int
    num_buckets: int
    max_bucket: int
    edges: torch.Tensor
    edges32: torch.Tensor
    time32: torch.Tensor
    time_base: torch.Tensor
    next32: torch.Tensor
    next_base: torch.Tensor
    time64: torch.Tensor
    next64: torch.Tensor
    seq_wide: torch.Tensor
    summary: torch.Tensor
    dpos: torch.Tensor
    dts: torch.Tensor


class Prepared(NamedTuple):
    """A call's kernel bias and what folding its gradients needs."""

    args: Bias
    pad: int  # padding slots on each side of the position table
    n_pos: int  # 2P - 1


def _heads(w: torch.Tensor) -> torch.Tensor:
    """``(Hb, n)`` float32 contiguous (Hb = 1 for a shared table)."""
    return (w if w.dim() == 2 else w[None]).to(torch.float32).contiguous()


BASE_SPAN = 2**52
"""A chunk's minimum must lie less than this after its sequence's earliest time for its float64 base to be
exact, and so the difference of two bases (``d``) and every threshold a tile compares with."""


def _chunked(
    values: torch.Tensor, chunk: torch.Tensor, nchunks: int, origin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (int64) as int32 offsets from their chunk's minimum, and that minimum per row as float64,
    counted from ``origin`` (the row's sequence's earliest time, so any absolute times give exact bases); NaN
    for the rows of a chunk whose values span ``INT32_SPAN`` or more or whose minimum is ``BASE_SPAN`` or more
    after the origin (device ops only, no host read): tiles that meet such a chunk take the exact int64 path
    (``add_bias``), whatever the times are. Differences that overflow int64 wrap negative: wide as well."""
    big = torch.iinfo(torch.int64).max
    low = torch.full((nchunks,), big, dtype=torch.int64, device=values.device).scatter_reduce(0, chunk, values, "amin")
    high = torch.full((nchunks,), -big - 1, dtype=torch.int64, device=values.device).scatter_reduce(
        0, chunk, values, "amax"
    )
    span = high - low  # >= 0 unless it wrapped
    low_rows = low[chunk]
    after = low_rows - origin  # >= 0 unless it wrapped
    wide = ((span < 0) | (span >= INT32_SPAN))[chunk] | (after < 0) | (after >= BASE_SPAN)
    rel = values - low_rows
    base = after.to(torch.float64).masked_fill(wide, math.nan)
    return rel.clamp(min=0, max=INT32_SPAN).to(torch.int32), base


SUMMARY_GRAIN = 16
"""The smallest block a summary holds: every kernel tile is at least this (``config``)."""
SUMMARY_SLOTS = 2 * CHUNK // SUMMARY_GRAIN
"""Summary slots per chunk: ``CHUNK / b`` blocks for each block size ``b = 16, 32, .., CHUNK`` (31), one spare."""


def block_summaries(
    time32: torch.Tensor, next32: torch.Tensor, chunk: torch.Tensor, i: torch.Tensor, nchunks: int
) -> torch.Tensor:
    """int32 ``(nchunks, SUMMARY_SLOTS, 4)``: for every chunk, block size ``b`` (a power of two from
    ``SUMMARY_GRAIN`` to ``CHUNK``) and block ``j`` of the chunk (rows ``j b .. j b + b - 1`` of it), at slot
    ``SUMMARY_SLOTS - 2 CHUNK / b + j``: the min of ``time32``, minus its max, the min of ``next32``, minus its max
    (maxima negated: one ``amin`` makes all four). Rows past a sequence's end hold nothing (a block's
    bounds are its rows'), as the per-row reads clamp to the last row. Device ops only, no host read; a tile
    then reads two scalars instead of reducing a vector (``bias_tiles.block_span``)."""
    vals = torch.stack((time32, -time32, next32, -next32), 1)
    grains = CHUNK // SUMMARY_GRAIN
    slot = (chunk * grains + (i % CHUNK) // SUMMARY_GRAIN)[:, None].expand(-1, 4)
    top = torch.iinfo(torch.int32).max
    fine = torch.full((nchunks * grains, 4), top, dtype=torch.int32, device=vals.device)
    fine = fine.scatter_reduce_(0, slot, vals, "amin").view(nchunks, grains, 4)
    levels = [fine]
    while levels[-1].shape[1] > 1:
        x = levels[-1]
        levels.append(x.view(nchunks, x.shape[1] // 2, 2, 4).amin(2))
    levels.append(fine.new_zeros(nchunks, 1, 4))  # the spare slot
    return torch.cat(levels, 1)


def chunked_times(times: torch.Tensor, seq_offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, ...]:
    """The per-row time arguments of the kernels, as plain torch ops (the definition; ``prepare`` computes the
    same in a few Triton launches, ``bias_prepare``): ``time32``, ``time_base``, ``next32``, ``next_base``, the
    int64 next times, ``seq_wide`` and ``summary`` (``Bias``). ``times``: int64 ``(total,)``."""
    seq, i, length = row_coords(seq_offsets, total)
    t = torch.arange(total, device=times.device)
    nxt = times[torch.where(i + 1 < length, t + 1, t)]
    # Chunk c of sequence b gets flat slot offs[b] // CHUNK + b + c (as the block tables): no prefix sum.
    chunk = seq_offsets[seq] // CHUNK + seq + i // CHUNK
    nchunks = total // CHUNK + seq_offsets.numel() - 1
    big = torch.iinfo(torch.int64).max
    seq_low = torch.full((seq_offsets.numel() - 1,), big, dtype=torch.int64, device=times.device).scatter_reduce(
        0, seq, times, "amin"
    )[seq]  # every row's sequence's earliest time: the origin of its chunk bases
    time32, time_base = _chunked(times, chunk, nchunks, seq_low)
    next32, next_base = _chunked(nxt, chunk, nchunks, seq_low)
    wide_row = (time_base.isnan() | next_base.isnan()).to(torch.int32)
    seq_wide = torch.zeros(seq_offsets.numel() - 1, dtype=torch.int32, device=times.device).scatter_reduce_(
        0, seq, wide_row, "amax"
    )
    summary = block_summaries(time32, next32, chunk, i, nchunks)
    return time32, time_base, next32, next_base, nxt, seq_wide, summary


def prepare(rel_bias: RelativeBias, seq_offsets: torch.Tensor, total: int, with_grads: bool) -> Prepared:
    """The kernel arguments of a relative bias for a batch of ``total >= 1`` rows (device ops only, no host read:
    a few torch ops and ``bias_prepare``'s launches for the per-row times).

    ``seq_offsets``: int64 contiguous ``(B + 1,)``. Gradient buffers are zero-filled when ``with_grads``,
    else empty placeholders that no kernel reads.
    """
    n_pos = rel_bias.pos_w.shape[-1]
    half = (n_pos - 1) // 2  # P - 1
    pos = _heads(rel_bias.pos_w)
    pad = max(0, total + POS_SLACK - half)
    if pad:
        pos = torch.cat([pos[:, :1].expand(-1, pad), pos, pos[:, -1:].expand(-1, pad)], dim=1)
    ts = _heads(rel_bias.ts_w)
    times = rel_bias.timestamps.to(torch.int64).contiguous()
    time32, time_base, next32, next_base, nxt, seq_wide, summary = chunked_times_triton(
        times, seq_offsets, total, CHUNK, SUMMARY_GRAIN, SUMMARY_SLOTS, INT32_SPAN, BASE_SPAN
    )
    edges, edges32, max_bucket = edges_tensors(ts.shape[1] - 1, times.device)
    dpos = torch.zeros_like(pos) if with_grads else pos.new_empty(0)
    dts = torch.zeros_like(ts) if with_grads else ts.new_empty(0)
    args = Bias(
        pos,
        pos.stride(0) if pos.shape[0] > 1 else 0,
        pad + half,
        ts,
        ts.stride(0) if ts.shape[0] > 1 else 0,
        ts.shape[1] - 1,
        max_bucket,
        edges,
        edges32,
        time32,
        time_base,
        next32,
        next_base,
        times,
        nxt,
        seq_wide,
        summary,
        dpos,
        dts,
    )
    return Prepared(args, pad, n_pos)


def with_grad_buffers(prep: Prepared) -> Prepared:
    """``prep`` with zeroed gradient buffers (a forward's tables, reused by its backward)."""
    args = prep.args._replace(dpos=torch.zeros_like(prep.args.pos), dts=torch.zeros_like(prep.args.ts))
    return prep._replace(args=args)


def fold_position_grad(prep: Prepared) -> torch.Tensor:
    """The position table's gradient ``(Hb, 2P - 1)`` from the padded buffer: padding slots are clamped
    relative positions, so their sums belong to the end entries."""
    d, pad, n = prep.args.dpos, prep.pad, prep.n_pos
    if not pad:
        return d
    out = d[:, pad : pad + n].clone()
    out[:, 0] += d[:, :pad].sum(1)
    out[:, -1] += d[:, pad + n :].sum(1)
    return out


def table_grads(rel_bias: RelativeBias, prep: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``pos_w`` and ``ts_w``, shaped and typed like them."""
    dpos = fold_position_grad(prep)
    dts = prep.args.dts
    pos_w, ts_w = rel_bias.pos_w, rel_bias.ts_w
    return dpos.reshape(pos_w.shape).to(pos_w.dtype), dts.reshape(ts_w.shape).to(ts_w.dtype)
