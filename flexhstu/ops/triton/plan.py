"""Block plan: which key blocks a query block must visit, and which need no element mask.

Per query block the func rows are read once and reduced, per interval ``j``, to

* the **hull** ``[hlo_j, hhi_j)``: the union of the interval over the block's rows
  (min of starts, max of ends over non-empty rows); key blocks outside every hull
  are never loaded;
* the **core** ``[clo_j, chi_j)``: the part every row sees (max of starts, min of
  ends); a key block inside some core needs no element mask.

These four ``(RP,)`` vectors (RP = intervals rounded up to a power of two) drive
the loops of every kernel. The query-major kernels compute them in their
prologue; the key-major backward reads them from ``_plan_kernel``'s output,
which also records, per key block, the range of query blocks that see it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rules import row_interval
from .tables import first_block, locate_block


@triton.jit
def _no_bounds(RP: tl.constexpr):
    """Hulls and cores of no row: empty hulls, cores that cover nothing, ready for ``_fold_bounds``."""
    return (tl.full((RP,), 1 << 30, tl.int32), tl.zeros((RP,), tl.int32),
            tl.full((RP,), 1 << 30, tl.int32), tl.zeros((RP,), tl.int32))


@triton.jit
def _fold_bounds(hlo, hhi, clo, chi, s, e, row_ok, jr, j: tl.constexpr):
    nonempty = e > s
    hlo = tl.where(jr == j, tl.min(tl.where(nonempty, s, 1 << 30), axis=0), hlo)
    hhi = tl.where(jr == j, tl.max(tl.where(nonempty, e, 0), axis=0), hhi)
    clo = tl.where(jr == j, tl.max(tl.where(row_ok, s, 0), axis=0), clo)
    chi = tl.where(jr == j, tl.min(tl.where(row_ok, e, 1 << 30), axis=0), chi)
    return hlo, hhi, clo, chi


@triton.jit
def block_bounds(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, fx_t, fx_c, fx_w, fx_f,
                 NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr):
    """Per-interval hull and core of a query block: four ``(RP,)`` int32 vectors."""
    jr = tl.arange(0, RP)
    hlo, hhi, clo, chi = _no_bounds(RP)
    for j in tl.static_range((NFUNC + 1) // 2):
        s, e = row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, j, MODE, fx_t, fx_c, fx_w, fx_f, HAS_T)
        hlo, hhi, clo, chi = _fold_bounds(hlo, hhi, clo, chi, s, e, row_ok, jr, j)
    return hlo, hhi, clo, chi


@triton.jit
def kv_ranges(hlo, hhi, BLOCK_N: tl.constexpr, RP: tl.constexpr):
    """Merge the hulls (in key blocks) into disjoint ranges; returns start, length, exclusive cumsum.

    Interval ``j`` keeps the blocks of its hull past every hull that sorts
    before it (by start, then index), so each key block is visited exactly once
    whatever the order of the intervals in the func.
    """
    jr = tl.arange(0, RP)
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
def interval_visibility(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, cols, L, n0, hlo, hhi,
                        fx_t, fx_c, fx_w, fx_f,
                        NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr,
                        BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """Bool tile of visible pairs: ``(rows, cols)``, or ``(cols, rows)`` when TRANS.

    Only intervals whose hull meets this key block are evaluated, so an
    interval that is empty for the block's rows (a widened func's padding)
    costs one scalar test.
    """
    jr = tl.arange(0, RP)
    rel = tl.sum(tl.where((hlo < n0 + BLOCK_N) & (hhi > n0), 1 << jr, 0), axis=0)
    if TRANS:
        vis = (cols[:, None] < 0) & (rows[None, :] < 0)
    else:
        vis = (rows[:, None] < 0) & (cols[None, :] < 0)
    for j in tl.static_range((NFUNC + 1) // 2):
        if ((rel >> j) & 1) != 0:
            s, e = row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, j, MODE, fx_t, fx_c, fx_w, fx_f, HAS_T)
            if TRANS:
                vis = vis | ((cols[:, None] >= s[None, :]) & (cols[:, None] < e[None, :]))
            else:
                vis = vis | ((cols[None, :] >= s[:, None]) & (cols[None, :] < e[:, None]))
    return vis


@triton.jit
def _plan_kernel(FUNC, OFFS, NT, QTAB, BOUNDS, QLO, QHI,
                 stride_fh, stride_fj, stride_ft, n_qblocks, n_kblocks, fx_c, fx_w, fx_f,
                 NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per query block: store its hull/core vectors; per key block: min/max query block that sees it."""
    pid = tl.program_id(0)
    hf = tl.program_id(1)
    seq, qb = locate_block(QTAB, OFFS, pid, BLOCK_M)
    seq_start = tl.load(OFFS + seq).to(tl.int64)
    L = (tl.load(OFFS + seq + 1) - seq_start).to(tl.int32)
    if qb * BLOCK_M < L:
        fx_t = 0
        if HAS_T:
            fx_t = tl.load(NT + seq).to(tl.int32)
        rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        rows_g = seq_start + rows
        fbase = FUNC + hf * stride_fh
        hlo, hhi, clo, chi = block_bounds(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, fx_t, fx_c, fx_w, fx_f,
                                          NFUNC, MODE, HAS_T, RP)
        jr = tl.arange(0, RP)
        out = BOUNDS + (hf * n_qblocks + pid) * 4 * RP + jr
        tl.store(out, hlo)
        tl.store(out + RP, hhi)
        tl.store(out + 2 * RP, clo)
        tl.store(out + 3 * RP, chi)
        kbase = hf * n_kblocks + first_block(OFFS, seq, BLOCK_N)
        for j in tl.static_range((NFUNC + 1) // 2):
            blo = tl.sum(tl.where(jr == j, hlo // BLOCK_N, 0), axis=0)
            bhi = tl.sum(tl.where(jr == j, (hhi + BLOCK_N - 1) // BLOCK_N, 0), axis=0)
            for c0 in range(blo, bhi, 64):
                kbs = c0 + tl.arange(0, 64)
                m = kbs < bhi
                tl.atomic_min(QLO + kbase + kbs, qb + tl.zeros_like(kbs), mask=m)
                tl.atomic_max(QHI + kbase + kbs, qb + 1 + tl.zeros_like(kbs), mask=m)


# Register-resident intervals: for NFUNC <= 7 (up to four intervals) a block's row
# intervals are loaded once into eight vectors, so masking a key block reads no memory.
# Wider funcs take the general path above (row_interval reloads per key block).


@triton.jit
def load_intervals4(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, fx_t, fx_c, fx_w, fx_f,
                    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr):
    """Intervals 0..3 of each row as (s0, e0, ..., s3, e3); absent intervals are ``[0, 0)``."""
    s0, e0 = row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, 0, MODE, fx_t, fx_c, fx_w, fx_f, HAS_T)
    s1 = tl.zeros_like(rows)
    e1 = tl.zeros_like(rows)
    s2 = tl.zeros_like(rows)
    e2 = tl.zeros_like(rows)
    s3 = tl.zeros_like(rows)
    e3 = tl.zeros_like(rows)
    if NFUNC >= 3:
        s1, e1 = row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, 1, MODE, fx_t, fx_c, fx_w, fx_f, HAS_T)
    if NFUNC >= 5:
        s2, e2 = row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, 2, MODE, fx_t, fx_c, fx_w, fx_f, HAS_T)
    if NFUNC >= 7:
        s3, e3 = row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, 3, MODE, fx_t, fx_c, fx_w, fx_f, HAS_T)
    return s0, e0, s1, e1, s2, e2, s3, e3


@triton.jit
def bounds4(s0, e0, s1, e1, s2, e2, s3, e3, row_ok, NFUNC: tl.constexpr, RP: tl.constexpr):
    """block_bounds from register-resident intervals."""
    jr = tl.arange(0, RP)
    hlo, hhi, clo, chi = _no_bounds(RP)
    hlo, hhi, clo, chi = _fold_bounds(hlo, hhi, clo, chi, s0, e0, row_ok, jr, 0)
    if NFUNC >= 3:
        hlo, hhi, clo, chi = _fold_bounds(hlo, hhi, clo, chi, s1, e1, row_ok, jr, 1)
    if NFUNC >= 5:
        hlo, hhi, clo, chi = _fold_bounds(hlo, hhi, clo, chi, s2, e2, row_ok, jr, 2)
    if NFUNC >= 7:
        hlo, hhi, clo, chi = _fold_bounds(hlo, hhi, clo, chi, s3, e3, row_ok, jr, 3)
    return hlo, hhi, clo, chi


@triton.jit
def _inside(s, e, cols, TRANS: tl.constexpr):
    if TRANS:
        return (cols[:, None] >= s[None, :]) & (cols[:, None] < e[None, :])
    else:
        return (cols[None, :] >= s[:, None]) & (cols[None, :] < e[:, None])


@triton.jit
def mask4(s0, e0, s1, e1, s2, e2, s3, e3, cols, n0, hlo, hhi,
          NFUNC: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """interval_visibility from register-resident intervals; intervals whose hull misses the block are skipped."""
    jr = tl.arange(0, RP)
    rel = tl.sum(tl.where((hlo < n0 + BLOCK_N) & (hhi > n0), 1 << jr, 0), axis=0)
    vis = _inside(s0, e0, cols, TRANS) & ((rel & 1) != 0)
    if NFUNC >= 3:
        if (rel & 2) != 0:
            vis = vis | _inside(s1, e1, cols, TRANS)
    if NFUNC >= 5:
        if (rel & 4) != 0:
            vis = vis | _inside(s2, e2, cols, TRANS)
    if NFUNC >= 7:
        if (rel & 8) != 0:
            vis = vis | _inside(s3, e3, cols, TRANS)
    return vis
