"""The per-row times of ``bias_tables.prepare`` in four small launches instead of ~90 torch ops.

What they compute is ``bias_tables.chunked_times`` (plain torch, kept as the definition and the tests'
reference), bit for bit: per 256-row chunk of a sequence its time range, each row's int32 offset from its
chunk's minimum and that minimum's float64 distance from the sequence's earliest time (NaN for a wide
chunk), the same for the next times, which sequences hold a wide chunk, and the per-block summaries.
One program per chunk slot (``block_tables.block_table`` with 256-row blocks, over ``safe_offsets``, so that
bad offsets cannot make a program write outside its buffers): ``_chunk_ranges`` reduces its chunk and folds
its minimum into its sequence's origin (an atomic min), ``_chunk_rows`` writes the rows. On the H100 the
torch version cost ~0.6 ms of device time per call (B4 S8192), as much as the attention forward without
the bias; these launches ~10 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_tables import block_table, locate_block, safe_offsets

I64_MAX = tl.constexpr(2**63 - 1)
I32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_rows_of(TAB, OFFS, slot, CHUNK: tl.constexpr):
    """Chunk slot -> (sequence, its first row, the chunk's local rows, which of them exist, any at all)."""
    seq, c, seq_start, L = locate_block(TAB, OFFS, slot, CHUNK)
    local = c * CHUNK + tl.arange(0, CHUNK)
    return seq, seq_start, local, local < L, c * CHUNK < L, L


@triton.jit
def _times_of(T, seq_start, local, ok, L):
    """The rows' times and next times (a sequence's last row: its own), int64; ``ok`` rows only."""
    t = tl.load(T + seq_start + local, mask=ok, other=0)
    nxt = tl.load(T + seq_start + tl.where(local + 1 < L, local + 1, local), mask=ok, other=0)
    return t, nxt


@triton.jit
def _chunk_ranges(T, OFFS, TAB, RANGES, ORIGIN, CHUNK: tl.constexpr):
    """Per chunk slot: min and max of its times and next times into ``RANGES[slot, 0:4]``; its times' min folded
    into ``ORIGIN[seq]`` (the sequence's earliest time)."""
    slot = tl.program_id(0).to(tl.int64)  # the summary's offsets pass 2^31 beyond 2^24 slots
    seq, seq_start, local, ok, any_rows, L = _chunk_rows_of(TAB, OFFS, slot, CHUNK)
    if any_rows:
        t, nxt = _times_of(T, seq_start, local, ok, L)
        tmin = tl.min(tl.where(ok, t, I64_MAX), axis=0)
        tmax = tl.max(tl.where(ok, t, -I64_MAX - 1), axis=0)
        nmin = tl.min(tl.where(ok, nxt, I64_MAX), axis=0)
        nmax = tl.max(tl.where(ok, nxt, -I64_MAX - 1), axis=0)
        tl.store(RANGES + slot * 4, tmin)
        tl.store(RANGES + slot * 4 + 1, tmax)
        tl.store(RANGES + slot * 4 + 2, nmin)
        tl.store(RANGES + slot * 4 + 3, nmax)
        tl.atomic_min(ORIGIN + seq, tmin, sem="relaxed")


@triton.jit
def _offsets(v, low, high, origin, INT32_SPAN: tl.constexpr, BASE_SPAN: tl.constexpr):
    """``bias_tables._chunked`` for one chunk: the rows' int32 offsets, the chunk's base (NaN when wide), wide."""
    span = high - low  # >= 0 unless it wrapped
    after = low - origin  # >= 0 unless it wrapped
    wide = (span < 0) | (span >= INT32_SPAN) | (after < 0) | (after >= BASE_SPAN)
    rel = tl.minimum(tl.maximum(v - low, 0), INT32_SPAN).to(tl.int32)
    base = tl.where(wide, float("nan"), after.to(tl.float64))
    return rel, base, wide


@triton.jit
def _level(SUMMARY, slot, m, COL: tl.constexpr, SLOTS: tl.constexpr):
    """Store one block size's minima ``m`` (``n`` blocks a chunk) at slots ``SLOTS - 2 n ..`` of column COL, the
    slots ``bias_tiles.block_span`` reads; return the next size's."""
    n: tl.constexpr = m.shape[0]
    tl.store(SUMMARY + (slot * SLOTS + SLOTS - 2 * n + tl.arange(0, n)) * 4 + COL, m)
    return tl.min(tl.reshape(m, (n // 2, 2)), axis=1) if n > 1 else m


@triton.jit
def _store_summary(
    SUMMARY, slot, x, ok, COL: tl.constexpr, CHUNK: tl.constexpr, GRAIN: tl.constexpr, SLOTS: tl.constexpr
):
    """The min of ``x`` over every aligned block of GRAIN .. CHUNK rows (rows not ``ok``: none) into column COL:
    16 blocks of GRAIN rows at slot 0, 8 of 2 GRAIN at 16, .., the whole chunk at 30, 0 in the spare slot 31."""
    m = tl.min(tl.reshape(tl.where(ok, x, I32_MAX), (CHUNK // GRAIN, GRAIN)), axis=1)
    for _ in tl.static_range(5):  # CHUNK / GRAIN = 16 blocks, then 8, 4, 2, 1
        m = _level(SUMMARY, slot, m, COL, SLOTS)
    tl.store(SUMMARY + (slot * SLOTS + SLOTS - 1) * 4 + COL, 0)


@triton.jit
def _chunk_rows(
    T,
    OFFS,
    TAB,
    RANGES,
    ORIGIN,
    TIME32,
    TIME_BASE,
    NEXT32,
    NEXT_BASE,
    NEXT64,
    SEQ_WIDE,
    SUMMARY,
    CHUNK: tl.constexpr,
    GRAIN: tl.constexpr,
    SLOTS: tl.constexpr,
    INT32_SPAN: tl.constexpr,
    BASE_SPAN: tl.constexpr,
):
    """Per chunk slot: its rows' int32 offsets and bases, next times, its sequence's wide flag, its summaries."""
    slot = tl.program_id(0).to(tl.int64)  # the summary's offsets pass 2^31 beyond 2^24 slots
    seq, seq_start, local, ok, any_rows, L = _chunk_rows_of(TAB, OFFS, slot, CHUNK)
    t32 = tl.zeros((CHUNK,), dtype=tl.int32)
    n32 = tl.zeros((CHUNK,), dtype=tl.int32)
    if any_rows:
        t, nxt = _times_of(T, seq_start, local, ok, L)
        origin = tl.load(ORIGIN + seq)
        r = RANGES + slot * 4
        t32, tbase, twide = _offsets(t, tl.load(r), tl.load(r + 1), origin, INT32_SPAN, BASE_SPAN)
        n32, nbase, nwide = _offsets(nxt, tl.load(r + 2), tl.load(r + 3), origin, INT32_SPAN, BASE_SPAN)
        rows = seq_start + local
        tl.store(TIME32 + rows, t32, mask=ok)
        tl.store(TIME_BASE + rows, tbase + tl.zeros((CHUNK,), dtype=tl.float64), mask=ok)
        tl.store(NEXT32 + rows, n32, mask=ok)
        tl.store(NEXT_BASE + rows, nbase + tl.zeros((CHUNK,), dtype=tl.float64), mask=ok)
        tl.store(NEXT64 + rows, nxt, mask=ok)
        tl.atomic_max(SEQ_WIDE + seq, (twide | nwide).to(tl.int32), sem="relaxed")
    _store_summary(SUMMARY, slot, t32, ok, 0, CHUNK, GRAIN, SLOTS)
    _store_summary(SUMMARY, slot, -t32, ok, 1, CHUNK, GRAIN, SLOTS)
    _store_summary(SUMMARY, slot, n32, ok, 2, CHUNK, GRAIN, SLOTS)
    _store_summary(SUMMARY, slot, -n32, ok, 3, CHUNK, GRAIN, SLOTS)


def chunked_times_triton(
    times: torch.Tensor,
    seq_offsets: torch.Tensor,
    total: int,
    chunk: int,
    grain: int,
    slots: int,
    int32_span: int,
    base_span: int,
):
    """``bias_tables.chunked_times`` (same outputs, for valid offsets) in four launches: the safe offsets, the
    chunk table and the two kernels."""
    assert chunk == 16 * grain and slots == 2 * chunk // grain, "bias_prepare: summaries of five block sizes"
    dev = times.device
    nseq = seq_offsets.numel() - 1
    seq_offsets = safe_offsets(seq_offsets, total)
    tab, nchunks = block_table(seq_offsets, total, chunk)
    ranges = torch.empty(nchunks, 4, dtype=torch.int64, device=dev)
    origin = torch.full((max(nseq, 1),), 2**63 - 1, dtype=torch.int64, device=dev)
    time32 = torch.empty(total, dtype=torch.int32, device=dev)
    next32 = torch.empty(total, dtype=torch.int32, device=dev)
    time_base = torch.empty(total, dtype=torch.float64, device=dev)
    next_base = torch.empty(total, dtype=torch.float64, device=dev)
    next64 = torch.empty(total, dtype=torch.int64, device=dev)
    seq_wide = torch.zeros(nseq, dtype=torch.int32, device=dev)
    summary = torch.empty(nchunks, slots, 4, dtype=torch.int32, device=dev)
    if nchunks:
        _chunk_ranges[(nchunks,)](times, seq_offsets, tab, ranges, origin, CHUNK=chunk, num_warps=4)
        _chunk_rows[(nchunks,)](
            times,
            seq_offsets,
            tab,
            ranges,
            origin,
            time32,
            time_base,
            next32,
            next_base,
            next64,
            seq_wide,
            summary,
            CHUNK=chunk,
            GRAIN=grain,
            SLOTS=slots,
            INT32_SPAN=int32_span,
            BASE_SPAN=base_span,
            num_warps=4,
        )
    return time32, time_base, next32, next_base, next64, seq_wide, summary
