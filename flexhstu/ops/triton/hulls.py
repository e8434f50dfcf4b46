"""Block plan: which key blocks a query block must visit, and which need no element mask.

Per query block the func rows are read once and reduced, per interval ``j``, to

* the **hull** ``[hlo_j, hhi_j)``: the union of the interval over the block's rows
  (min of starts, max of ends over non-empty rows); key blocks outside every hull
  are never loaded;
* the **core** ``[clo_j, chi_j)``: the part every row sees (max of starts, min of
  ends); a key block inside some core needs no element mask.

These four ``(INTERVALS_POW2,)`` vectors (the interval count rounded up to a
power of two) drive the loops of every kernel. The query-major kernels compute
them in their prologue; the key-major backward reads them from
``_plan_kernel``'s output, which also records, per key block, the range of
query blocks that see it.

Every helper here takes the mask as ``func`` (one head's rows, ``head_func``),
``targets`` (this sequence's num_targets) and ``rule`` (``RuleArgs``), and the
query block as ``rows`` (local positions), ``rows_g`` (jagged rows), ``row_ok``
(``rows < L``) and ``L``.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .block_tables import first_block, locate_block
from .row_intervals import BIG, head_func, row_interval, sequence_targets


@triton.jit
def _bounds_combine(hlo_a, hhi_a, clo_a, chi_a, hlo_b, hhi_b, clo_b, chi_b):
    """Hulls widen (min of starts, max of ends); cores narrow (max of starts, min of ends)."""
    return tl.minimum(hlo_a, hlo_b), tl.maximum(hhi_a, hhi_b), tl.maximum(clo_a, clo_b), tl.minimum(chi_a, chi_b)


@triton.jit
def _no_bounds(BLOCK_M: tl.constexpr, INTERVALS_POW2: tl.constexpr):
    """Per-row contributions of no interval: ``(BLOCK_M, INTERVALS_POW2)`` tiles whose reduction is an empty
    hull and an empty core in every slot."""
    big = tl.full((BLOCK_M, INTERVALS_POW2), BIG, tl.int32)
    zero = tl.zeros((BLOCK_M, INTERVALS_POW2), tl.int32)
    return big, zero, big, zero


@triton.jit
def _place_interval(parts, s, e, row_ok, j: tl.constexpr):
    """Write the rows' interval ``[s, e)`` into slot ``j`` of the per-row contribution tiles ``parts``."""
    hs, he, cs, ce = parts
    jr = tl.arange(0, hs.shape[1])
    slot = jr[None, :] == j
    nonempty = e > s
    hs = tl.where(slot, tl.where(nonempty, s, BIG)[:, None], hs)
    he = tl.where(slot, tl.where(nonempty, e, 0)[:, None], he)
    cs = tl.where(slot, tl.where(row_ok, s, 0)[:, None], cs)
    ce = tl.where(slot, tl.where(row_ok, e, BIG)[:, None], ce)
    return hs, he, cs, ce


@triton.jit
def _reduce_bounds(parts):
    """The four ``(INTERVALS_POW2,)`` vectors (hull start/end, core start/end), in one reduction over the rows:
    one exchange between warps for all intervals and all four statistics."""
    hs, he, cs, ce = parts
    return tl.reduce((hs, he, cs, ce), 0, _bounds_combine)


@triton.jit
def block_bounds(func, targets, rule, rows, rows_g, row_ok, L,
                 NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, INTERVALS_POW2: tl.constexpr):
    """Per-interval hull and core of a query block: four ``(INTERVALS_POW2,)`` int32 vectors."""
    parts = _no_bounds(rows.shape[0], INTERVALS_POW2)
    for j in tl.static_range((NFUNC + 1) // 2):
        s, e = row_interval(func=func, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok, L=L,
                            j=j, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
        parts = _place_interval(parts, s, e, row_ok, j)
    return _reduce_bounds(parts)


@triton.jit
def kv_ranges(hlo, hhi, BLOCK_N: tl.constexpr, INTERVALS_POW2: tl.constexpr):
    """Merge the hulls (in key blocks) into disjoint ranges; returns start, length, exclusive cumsum.

    Interval ``j`` keeps the blocks of its hull past every hull that sorts
    before it (by start, then index), so each key block is visited exactly once
    whatever the order of the intervals in the func.
    """
    jr = tl.arange(0, INTERVALS_POW2)
    blo = hlo // BLOCK_N
    bhi = (hhi + BLOCK_N - 1) // BLOCK_N
    before = (blo[None, :] < blo[:, None]) | ((blo[None, :] == blo[:, None]) & (jr[None, :] < jr[:, None]))
    prev_hi = tl.max(tl.where(before, bhi[None, :], 0), axis=1)
    start = tl.maximum(blo, prev_hi)
    length = tl.maximum(bhi - start, 0)
    return start, length, tl.cumsum(length, 0) - length


@triton.jit
def kv_block_at(it, start, length, cumx):
    """The key block visited at flat iteration ``it`` of the merged ranges."""
    sel = (cumx <= it) & (it < cumx + length)
    return tl.sum(tl.where(sel, start + it - cumx, 0), axis=0)


@triton.jit
def block_is_full(n0, n1, clo, chi):
    """True when every row of the query block sees all of key columns ``[n0, n1)``."""
    return tl.max(tl.where((clo <= n0) & (n1 <= chi), 1, 0), axis=0) != 0


@triton.jit
def _meets_block(hlo, hhi, n0, BLOCK_N: tl.constexpr, INTERVALS_POW2: tl.constexpr):
    """Bit ``j`` set when the hull of interval ``j`` meets key block ``[n0, n0 + BLOCK_N)``."""
    jr = tl.arange(0, INTERVALS_POW2)
    return tl.sum(tl.where((hlo < n0 + BLOCK_N) & (hhi > n0), 1 << jr, 0), axis=0)


@triton.jit
def _inside(s, e, cols, TRANS: tl.constexpr, FROM_ZERO: tl.constexpr):
    """Bool tile: key column ``cols`` in ``[s, e)`` of each row; ``(rows, cols)``, or ``(cols, rows)`` when TRANS.

    Two operations per element: ``(col - s)`` as unsigned is below ``max(e - s, 0)`` exactly when
    ``s <= col < e`` (a column left of ``s`` wraps to a large unsigned value). FROM_ZERO (``s`` is 0 on
    every row, as for interval 0): one comparison.
    """
    if FROM_ZERO:
        if TRANS:
            return cols[:, None] < e[None, :]
        else:
            return cols[None, :] < e[:, None]
    else:
        span = tl.maximum(e - s, 0).to(tl.uint32)
        if TRANS:
            return (cols[:, None] - s[None, :]).to(tl.uint32) < span[None, :]
        else:
            return (cols[None, :] - s[:, None]).to(tl.uint32) < span[:, None]


@triton.jit
def _nothing_visible(rows, cols, TRANS: tl.constexpr):
    """An all-False ``(rows, cols)`` tile (``(cols, rows)`` when TRANS): the start of a union of intervals."""
    if TRANS:
        return tl.zeros((cols.shape[0], rows.shape[0]), tl.int1)
    else:
        return tl.zeros((rows.shape[0], cols.shape[0]), tl.int1)


@triton.jit
def interval_visibility(func, targets, rule, rows, rows_g, row_ok, L, cols, n0, hlo, hhi,
                        NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr,
                        INTERVALS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """Bool tile of visible pairs: ``(rows, cols)``, or ``(cols, rows)`` when TRANS.

    Only intervals whose hull meets this key block are read and evaluated, so an
    interval that is empty for the block's rows (a widened func's padding)
    costs one scalar test.
    """
    meets = _meets_block(hlo, hhi, n0, BLOCK_N, INTERVALS_POW2)
    vis = _nothing_visible(rows, cols, TRANS)
    for j in tl.static_range((NFUNC + 1) // 2):
        if ((meets >> j) & 1) != 0:
            s, e = row_interval(func=func, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok, L=L,
                                j=j, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
            vis = vis | _inside(s, e, cols, TRANS, j == 0)
    return vis


# Register-resident intervals: for NFUNC <= 7 (up to four intervals) a block's row
# intervals are loaded once into a tuple of eight vectors, so masking a key block
# reads no memory (mask_from_intervals). Wider funcs take the general path above
# (row_interval reloads per key block).


@triton.jit
def load_row_intervals(func, targets, rule, rows, rows_g, row_ok, L,
                       NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """Intervals 0..3 of each row as ``(s0, e0, ..., s3, e3)``; absent intervals are ``[0, 0)``."""
    s0, e0 = row_interval(func=func, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok, L=L,
                          j=0, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
    s1 = tl.zeros_like(rows)
    e1 = tl.zeros_like(rows)
    s2 = tl.zeros_like(rows)
    e2 = tl.zeros_like(rows)
    s3 = tl.zeros_like(rows)
    e3 = tl.zeros_like(rows)
    if NFUNC >= 3:
        s1, e1 = row_interval(func=func, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok, L=L,
                              j=1, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
    if NFUNC >= 5:
        s2, e2 = row_interval(func=func, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok, L=L,
                              j=2, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
    if NFUNC >= 7:
        s3, e3 = row_interval(func=func, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok, L=L,
                              j=3, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
    return s0, e0, s1, e1, s2, e2, s3, e3


@triton.jit
def bounds_from_intervals(intervals, row_ok, NFUNC: tl.constexpr, INTERVALS_POW2: tl.constexpr):
    """``block_bounds`` from the tuple of ``load_row_intervals``."""
    s0, e0, s1, e1, s2, e2, s3, e3 = intervals
    parts = _no_bounds(s0.shape[0], INTERVALS_POW2)
    parts = _place_interval(parts, s0, e0, row_ok, 0)
    if NFUNC >= 3:
        parts = _place_interval(parts, s1, e1, row_ok, 1)
    if NFUNC >= 5:
        parts = _place_interval(parts, s2, e2, row_ok, 2)
    if NFUNC >= 7:
        parts = _place_interval(parts, s3, e3, row_ok, 3)
    return _reduce_bounds(parts)


_OPAQUE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _opaque(x):
    """``x`` through an instruction the compiler may neither drop nor move (the interpreter, which has no inline
    assembly, gets ``x``): a branch that holds it is compiled as a branch, not flattened into selects."""
    if _OPAQUE:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return x


@triton.jit
def _visible_among(intervals, rows, cols, COUNT: tl.constexpr, TRANS: tl.constexpr):
    """Visible pairs of intervals ``0..COUNT-1`` of the register-resident ``intervals``, all evaluated: a test
    per interval and block ("does its hull meet the block") costs more than it saves, since the compiler
    flattens it into the per-element selects (sm_90 SASS: 284 instructions per masked 64 x 64 block for two
    intervals with the tests, 144 without). With more than two intervals every bound goes through
    ``_opaque``, so that the compiler shares no work with ``mask_from_intervals``'s two-interval step (a
    shared test would be hoisted above the branch between them, its predicates kept in registers)."""
    s0, e0, s1, e1, s2, e2, s3, e3 = intervals
    if COUNT <= 2:
        vis = _inside(s0, e0, cols, TRANS, True)
        if COUNT == 2:
            vis = vis | _inside(s1, e1, cols, TRANS, False)
    else:
        vis = _inside(s0, _opaque(e0), cols, TRANS, True) | _inside(_opaque(s1), e1, cols, TRANS, False)
        vis = vis | _inside(_opaque(s2), e2, cols, TRANS, False)
        if COUNT == 4:
            vis = vis | _inside(_opaque(s3), e3, cols, TRANS, False)
    return vis


@triton.jit
def wide_hull(hlo, hhi, INTERVALS_POW2: tl.constexpr):
    """``(lo, hi)``: the key columns that the hulls of intervals 2 and up span together (``lo >= hi`` when they
    are all empty); computed once per query block, so that a key block's choice of masking step is two scalar
    comparisons (``mask_from_intervals``)."""
    jr = tl.arange(0, INTERVALS_POW2)
    wide = (jr >= 2) & (hlo < hhi)
    return tl.min(tl.where(wide, hlo, BIG), axis=0), tl.max(tl.where(wide, hhi, 0), axis=0)


@triton.jit
def mask_from_intervals(x, intervals, rows, cols, n0, wide_lo, wide_hi, NFUNC: tl.constexpr,
                        BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """``x`` zeroed where the register-resident ``intervals`` (``load_row_intervals``) hide a pair: the rule of
    ``interval_visibility``.

    With three or four intervals, a key block outside ``[wide_lo, wide_hi)`` (``wide_hull``: where intervals 2
    and 3 can be) takes the two-interval masking step: the choice is two scalar comparisons per block and a
    real branch (``_opaque`` keeps the compiler from merging the two steps), so the empty intervals of a
    widened func cost nothing per element.
    """
    COUNT: tl.constexpr = (NFUNC + 1) // 2
    if COUNT <= 2:  # noqa: SIM114 (a constexpr test, then a runtime one: Python's `or` cannot join them)
        x = tl.where(_visible_among(intervals, rows, cols, COUNT, TRANS), x, 0.0)
    elif (wide_lo < n0 + BLOCK_N) & (wide_hi > n0):
        x = tl.where(_visible_among(intervals, rows, cols, COUNT, TRANS), x, 0.0)
    else:
        x = tl.where(_visible_among(intervals, rows, cols, 2, TRANS), x, 0.0)
    return x


@triton.jit
def _plan_kernel(func, rule, OFFS, QTAB, BOUNDS, QLO, QHI, n_qblocks, n_kblocks,
                 NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, INTERVALS_POW2: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per query block: store its hull/core vectors ``BOUNDS (Hplan, n_qblocks, 4, INTERVALS_POW2)``;
    per key block: the first (``QLO``) and past-the-last (``QHI``) query block that sees it."""
    pid = tl.program_id(0)
    hf = tl.program_id(1)
    seq, qb, seq_start, L = locate_block(QTAB, OFFS, pid, BLOCK_M)
    if qb * BLOCK_M < L:
        rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        hlo, hhi, clo, chi = block_bounds(
            func=head_func(func, hf), targets=sequence_targets(rule, seq, HAS_TARGETS), rule=rule,
            rows=rows, rows_g=seq_start + rows, row_ok=row_ok, L=L,
            NFUNC=NFUNC, MODE=MODE, HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2)
        jr = tl.arange(0, INTERVALS_POW2)
        out = BOUNDS + (hf * n_qblocks + pid) * 4 * INTERVALS_POW2 + jr
        tl.store(out, hlo)
        tl.store(out + INTERVALS_POW2, hhi)
        tl.store(out + 2 * INTERVALS_POW2, clo)
        tl.store(out + 3 * INTERVALS_POW2, chi)
        kbase = hf * n_kblocks + first_block(OFFS, seq, BLOCK_N)
        for j in tl.static_range((NFUNC + 1) // 2):
            blo = tl.sum(tl.where(jr == j, hlo // BLOCK_N, 0), axis=0)
            bhi = tl.sum(tl.where(jr == j, (hhi + BLOCK_N - 1) // BLOCK_N, 0), axis=0)
            for c0 in range(blo, bhi, 64):
                kbs = c0 + tl.arange(0, 64)
                m = kbs < bhi
                tl.atomic_min(QLO + kbase + kbs, qb + tl.zeros_like(kbs), mask=m)
                tl.atomic_max(QHI + kbase + kbs, qb + 1 + tl.zeros_like(kbs), mask=m)


@triton.jit
def _split_list_kernel(OFFS, KTAB, QLO, QHI, ITEM_KB, ITEM_LO, ITEM_HI, NITEMS, n_kblocks, chunk, cap,
                       CAUSAL: tl.constexpr, MAX_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CHUNK: tl.constexpr):
    """Grid ``(cdiv(n_kblocks, CHUNK), Hplan)``: the dK/dV kernel's *extra* work items (``block_plan.SplitList``)
    of ``CHUNK`` key blocks of one plan row.

    A key block whose query range ``[q_lo, q_hi)`` holds more than ``chunk`` query blocks is cut into
    ``n = min(cdiv(range, chunk), MAX_SPLIT)`` pieces of ``chunk`` blocks, the last running to ``q_hi``. The
    key block's own program takes piece 0; pieces ``1 .. n - 1`` are listed as (key block, lo, hi), in piece
    order, at slots the program reserves with one atomic add on ``NITEMS`` (zeroed before; it ends as the
    row's count), so the programs run in parallel and the lists of different programs land in any order.
    Under CAUSAL the ranges are closed-form, else read from ``QLO``/``QHI`` (``_plan_kernel``)."""
    hp = tl.program_id(1)
    jj = 1 + tl.arange(0, MAX_SPLIT)  # piece numbers 1 .. MAX_SPLIT (the last never used)
    kf = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = kf < n_kblocks
    if CAUSAL:
        seq = tl.load(KTAB + kf, mask=ok, other=0)
        kb = kf - first_block(OFFS, seq, BLOCK_N)
        L = (tl.load(OFFS + seq + 1, mask=ok, other=0) - tl.load(OFFS + seq, mask=ok, other=0)).to(tl.int32)
        ok = ok & (kb * BLOCK_N < L)
        q_lo = kb * BLOCK_N // BLOCK_M
        q_hi = (L + BLOCK_M - 1) // BLOCK_M
    else:
        q_lo = tl.load(QLO + hp * n_kblocks + kf, mask=ok, other=0)
        q_hi = tl.load(QHI + hp * n_kblocks + kf, mask=ok, other=0)
    span = tl.where(ok, q_hi - q_lo, 0)
    pieces = tl.minimum((span + chunk - 1) // chunk, MAX_SPLIT)
    extra = tl.where(span > chunk, pieces - 1, 0)
    count = tl.sum(extra, axis=0)
    if count > 0:
        start = tl.atomic_add(NITEMS + hp, count) + tl.cumsum(extra, 0) - extra
        lo = q_lo[:, None] + jj[None, :] * chunk
        hi = tl.where(jj[None, :] == pieces[:, None] - 1, q_hi[:, None], lo + chunk)
        at = hp.to(tl.int64) * cap + start[:, None] + jj[None, :] - 1
        m = jj[None, :] <= extra[:, None]
        tl.store(ITEM_KB + at, kf[:, None] + tl.zeros_like(lo), mask=m)
        tl.store(ITEM_LO + at, lo, mask=m)
        tl.store(ITEM_HI + at, hi, mask=m)
