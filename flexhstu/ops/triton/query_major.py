"""The query-major walk shared by the forward and the dQ kernel.

One program owns a query block and visits the key blocks its rows see: under
MODE_CAUSAL two loops (blocks wholly before the first row, then the diagonal
blocks), otherwise the merged interval hulls of the block, masking only the key
blocks that no core covers. ``BLOCK_FN`` computes one key block's contribution
as a pair ``(x, y)`` (forward: ``(silu(s), v)``; dQ: ``(dS / c, k)``), added as
``acc += x @ y``; the walk zeroes ``x`` where the mask hides a pair.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .bias_tiles import bias_rows, query_major_bias
from .block_tables import locate_block
from .hulls import (
    block_bounds,
    block_is_full,
    bounds_from_intervals,
    interval_visibility,
    kv_block_at,
    kv_ranges,
    load_row_intervals,
    mask_from_intervals,
    wide_hull,
)
from .memory import load_rows, store_rows
from .rab_tiles import add_rab, rab_base
from .row_intervals import MODE_CAUSAL, head_func, sequence_targets
from .silu import finite_below

INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # accumulate_e4m3


@triton.jit
def key_block_scores(q, K, V, h, seq_start, L, n0, rows, alpha, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr,
                     DIM_V: tl.constexpr, TILE_QK: tl.constexpr, TILE_V: tl.constexpr, FLOOR_SCORES: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BIAS, BROWS, HAS_BIAS: tl.constexpr, WIDE_TIMES: tl.constexpr,
                     RAB=None, RAB_BASE=None, HAS_RAB: tl.constexpr = False, SCALES=None, QSC=None,
                     HAS_SCALES: tl.constexpr = False):
    """Key block ``n0`` of a query-major program: its columns, ``k``, ``v`` and the scores ``alpha q k^T``
    (with HAS_SCALES, e4m3 ``q``, ``k`` whose dot is scaled by ``QSC``, the rows' ``alpha`` times their scales, and
    by the keys' scales from ``SCALES``: ``args.Fp8Scales``),
    plus the relative bias with HAS_BIAS (``BROWS``: the program's ``bias_rows``; WIDE_TIMES: the int64 path,
    ``bias_tiles.add_bias``) or the dense bias with HAS_RAB (``RAB``: ``rab_tiles.Rab``, ``RAB_BASE`` its
    sequence and head), floored with FLOOR_SCORES (``silu.finite_below``). The set-up every block function
    (``forward.attend``, ``backward.dq_block``) shares."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    k = load_rows(K, seq_start + cols, col_ok, h, DIM_QK, TILE_QK)
    v = load_rows(V, seq_start + cols, col_ok, h, DIM_V, TILE_V)
    if HAS_SCALES:
        kscale = tl.load(SCALES.k + (seq_start + cols) * SCALES.stride_t + h, mask=col_ok, other=0.0)
        # The two scales first: the e4m3 dot reaches 448^2 * D, and times a huge row scale alone it would
        # overflow where the product with a tiny key scale is finite.
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * (QSC[:, None] * kscale[None, :])
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * alpha
    if HAS_BIAS:
        s = query_major_bias(s, BIAS, BROWS, h, seq_start, L, rows, cols, n0, WIDE_TIMES, DOT_PRECISION)
    if HAS_RAB:
        s = add_rab(s, RAB, RAB_BASE, L, rows, cols, False)
    if FLOOR_SCORES:
        s = finite_below(s)
    return cols, k, v, s


@triton.jit
def accumulate_e4m3(acc, x, y):
    """``acc + x @ y`` for e4m3 ``y`` (``flexhstu.ops.fp8``): ``y`` widened to bfloat16 and ``x`` cast to it, a
    bfloat16 product. An e4m3 product, with ``x`` scaled per row to the e4m3 range and rounded, took twice as long
    on an H100 (the tensor cores read an e4m3 ``y`` only transposed, through shared memory). Under the interpreter,
    whose bfloat16 dots are wrong, the product is float32."""
    if INTERPRETING:
        acc += tl.dot(x, y.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        acc += tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16), out_dtype=tl.float32)
    return acc


@triton.jit
def query_major_walk(acc, q, do, K, V, func, rule, h, seq, seq_start, L, m0, rows, row_ok, rows_g, alpha,
                     BLOCK_FN: tl.constexpr, NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr,
                     INTERVALS_POW2: tl.constexpr, INTERVALS_IN_REGISTERS: tl.constexpr, FAST_SIGMOID: tl.constexpr,
                     FLOOR_SCORES: tl.constexpr,
                     DOT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, DIM_V: tl.constexpr,
                     TILE_QK: tl.constexpr, TILE_V: tl.constexpr, BIAS=None, BROWS=None,
                     HAS_BIAS: tl.constexpr = False, WIDE_TIMES: tl.constexpr = False, SPLIT=0,
                     N_SPLITS: tl.constexpr = 1, RAB=None, RAB_BASE=None, HAS_RAB: tl.constexpr = False,
                     SCALES=None, QSC=None, HAS_SCALES: tl.constexpr = False):
    """``acc (BLOCK_M, D)`` plus the contribution of every key block that query block ``m0`` sees.

    ``q (BLOCK_M, DIM_QK)`` and ``do (BLOCK_M, DIM_V)`` are the block's tiles (the forward passes ``q``
    for ``do``, unused); ``K``, ``V``: ``Jagged``. ``BIAS``, ``BROWS``, HAS_BIAS, WIDE_TIMES: passed to
    ``BLOCK_FN`` (the relative bias, the program's rows' times, the int64 path for wide chunks), as are ``RAB``,
    ``RAB_BASE``, HAS_RAB (a dense bias, ``rab_tiles``). With
    N_SPLITS > 1 only the key blocks of split ``SPLIT`` (every N_SPLITS-th of the walk, from the SPLIT-th) are
    visited: the caller sums the splits. With HAS_SCALES (the delta kernel's e4m3 inputs) ``SCALES`` and ``QSC``
    go to ``BLOCK_FN`` and each tile's ``P V`` is added by ``accumulate_e4m3``.
    """
    if MODE == MODE_CAUSAL:
        # Key blocks wholly at or before the first row need no mask; the rest meet the diagonal.
        n_full = (m0 + 1) // BLOCK_N
        n_end = (tl.minimum(m0 + BLOCK_M, L) + BLOCK_N - 1) // BLOCK_N
        # Split SPLIT takes the key blocks kb with kb % N_SPLITS == SPLIT, in both loops.
        diag_first = n_full if N_SPLITS == 1 else n_full + (SPLIT - n_full % N_SPLITS + N_SPLITS) % N_SPLITS
        for kb in range(SPLIT, n_full, N_SPLITS):
            x, y = BLOCK_FN(q=q, do=do, K=K, V=V, h=h, seq_start=seq_start, L=L, n0=kb * BLOCK_N, rows=rows,
                            alpha=alpha, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V, TILE_QK=TILE_QK, TILE_V=TILE_V,
                            CAUSAL_MASK=False, FAST_SIGMOID=FAST_SIGMOID, FLOOR_SCORES=FLOOR_SCORES,
                            DOT_PRECISION=DOT_PRECISION,
                            BIAS=BIAS, BROWS=BROWS, HAS_BIAS=HAS_BIAS, WIDE_TIMES=WIDE_TIMES,
                            RAB=RAB, RAB_BASE=RAB_BASE, HAS_RAB=HAS_RAB, SCALES=SCALES, QSC=QSC,
                            HAS_SCALES=HAS_SCALES)
            if HAS_SCALES:
                acc = accumulate_e4m3(acc, x, y)
            else:
                acc += tl.dot(x.to(y.dtype), y, input_precision=DOT_PRECISION)
        for kb in range(diag_first, n_end, N_SPLITS):
            x, y = BLOCK_FN(q=q, do=do, K=K, V=V, h=h, seq_start=seq_start, L=L, n0=kb * BLOCK_N, rows=rows,
                            alpha=alpha, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V, TILE_QK=TILE_QK, TILE_V=TILE_V,
                            CAUSAL_MASK=True, FAST_SIGMOID=FAST_SIGMOID, FLOOR_SCORES=FLOOR_SCORES,
                            DOT_PRECISION=DOT_PRECISION,
                            BIAS=BIAS, BROWS=BROWS, HAS_BIAS=HAS_BIAS, WIDE_TIMES=WIDE_TIMES,
                            RAB=RAB, RAB_BASE=RAB_BASE, HAS_RAB=HAS_RAB, SCALES=SCALES, QSC=QSC,
                            HAS_SCALES=HAS_SCALES)
            if HAS_SCALES:
                acc = accumulate_e4m3(acc, x, y)
            else:
                acc += tl.dot(x.to(y.dtype), y, input_precision=DOT_PRECISION)
    else:
        targets = sequence_targets(rule, seq, HAS_TARGETS)
        func_h = head_func(func, h)  # a new name: the tuple's field types differ
        if INTERVALS_IN_REGISTERS:
            intervals = load_row_intervals(func=func_h, targets=targets, rule=rule, rows=rows, rows_g=rows_g,
                                           row_ok=row_ok, L=L, NFUNC=NFUNC, MODE=MODE, HAS_TARGETS=HAS_TARGETS)
            hlo, hhi, clo, chi = bounds_from_intervals(intervals, row_ok, NFUNC, INTERVALS_POW2)
        else:
            hlo, hhi, clo, chi = block_bounds(func=func_h, targets=targets, rule=rule, rows=rows, rows_g=rows_g,
                                              row_ok=row_ok, L=L, NFUNC=NFUNC, MODE=MODE, HAS_TARGETS=HAS_TARGETS,
                                              INTERVALS_POW2=INTERVALS_POW2)
        kstart, klen, kcum = kv_ranges(hlo, hhi, BLOCK_N, INTERVALS_POW2)
        wide_lo, wide_hi = wide_hull(hlo, hhi, INTERVALS_POW2) if NFUNC >= 5 else (0, 0)
        for it in range(SPLIT, tl.sum(klen, axis=0), N_SPLITS):
            n0 = kv_block_at(it, kstart, klen, kcum) * BLOCK_N
            x, y = BLOCK_FN(q=q, do=do, K=K, V=V, h=h, seq_start=seq_start, L=L, n0=n0, rows=rows,
                            alpha=alpha, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V, TILE_QK=TILE_QK, TILE_V=TILE_V,
                            CAUSAL_MASK=False, FAST_SIGMOID=FAST_SIGMOID, FLOOR_SCORES=FLOOR_SCORES,
                            DOT_PRECISION=DOT_PRECISION,
                            BIAS=BIAS, BROWS=BROWS, HAS_BIAS=HAS_BIAS, WIDE_TIMES=WIDE_TIMES,
                            RAB=RAB, RAB_BASE=RAB_BASE, HAS_RAB=HAS_RAB, SCALES=SCALES, QSC=QSC,
                            HAS_SCALES=HAS_SCALES)
            if not block_is_full(n0, tl.minimum(n0 + BLOCK_N, L), clo, chi):
                cols = n0 + tl.arange(0, BLOCK_N)
                if INTERVALS_IN_REGISTERS:
                    x = mask_from_intervals(x=x, intervals=intervals, rows=rows, cols=cols, n0=n0, wide_lo=wide_lo,
                                            wide_hi=wide_hi, NFUNC=NFUNC, BLOCK_N=BLOCK_N, TRANS=False)
                else:
                    vis = interval_visibility(func=func_h, targets=targets, rule=rule, rows=rows, rows_g=rows_g,
                                              row_ok=row_ok, L=L, cols=cols, n0=n0, hlo=hlo, hhi=hhi, NFUNC=NFUNC,
                                              MODE=MODE, HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2,
                                              BLOCK_N=BLOCK_N, TRANS=False)
                    x = tl.where(vis, x, 0.0)
            if HAS_SCALES:
                acc = accumulate_e4m3(acc, x, y)
            else:
                acc += tl.dot(x.to(y.dtype), y, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def query_major_program(Q, DO, K, V, OUT, func, rule, OFFS, QTAB, n_flat, alpha, out_scale,
                        BLOCK_FN: tl.constexpr, WITH_DO: tl.constexpr,
                        NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr,
                        INTERVALS_POW2: tl.constexpr,
                        FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr,
                        DIM_QK: tl.constexpr, DIM_V: tl.constexpr, TILE_QK: tl.constexpr, TILE_V: tl.constexpr,
                        ROW_SCALE=None, HAS_ROW_SCALE: tl.constexpr = False, BIAS=None,
                        HAS_BIAS: tl.constexpr = False, RAB=None, HAS_RAB: tl.constexpr = False):
    """One query-major program: locate its query block (last flat blocks first: under causal-like masks
    they carry the most key blocks), load ``q`` (and ``do`` when WITH_DO), walk, store
    ``out_scale * acc`` into ``OUT``: ``(total, H, DIM_QK)`` (dQ) when WITH_DO, else ``(total, H, DIM_V)``;
    each row also times ``ROW_SCALE[row]`` (float32 ``(total,)``) when HAS_ROW_SCALE. With HAS_BIAS the
    rows' times are read once here and ``BIAS`` (``bias.Bias``) is added to every score; with HAS_RAB the dense
    ``RAB`` (``rab_tiles.Rab``) is."""
    OUT_DIM: tl.constexpr = DIM_QK if WITH_DO else DIM_V
    # Register-resident intervals for funcs of up to four intervals (load_row_intervals holds four).
    INTERVALS_IN_REGISTERS: tl.constexpr = NFUNC <= 7
    OUT_TILE: tl.constexpr = TILE_QK if WITH_DO else TILE_V
    h = tl.program_id(1)
    seq, qb, seq_start, L = locate_block(QTAB, OFFS, n_flat - 1 - tl.program_id(0), BLOCK_M)
    m0 = qb * BLOCK_M
    if m0 < L:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        rows_g = seq_start + rows
        q = load_rows(Q, rows_g, row_ok, h, DIM_QK, TILE_QK)
        do = load_rows(DO, rows_g, row_ok, h, DIM_V, TILE_V) if WITH_DO else q
        acc = tl.zeros((BLOCK_M, OUT_TILE), dtype=tl.float32)
        brows = bias_rows(BIAS, seq, seq_start, L, rows, m0) if HAS_BIAS else None
        rab_b = rab_base(RAB, seq, h) if HAS_RAB else None
        # With a bias, two copies of the walk: the one holding the int64 path for wide chunks runs only where the
        # sequence has one (bias.add_bias); seq_wide is 0 or 1.
        wide = tl.load(BIAS.seq_wide + seq) if HAS_BIAS else 0
        for copy in tl.static_range(2 if HAS_BIAS else 1):
            if wide == copy:
                acc = query_major_walk(
                    acc=acc, q=q, do=do, K=K, V=V, func=func, rule=rule, h=h, seq=seq, seq_start=seq_start, L=L,
                    m0=m0, rows=rows, row_ok=row_ok, rows_g=rows_g, alpha=alpha, BLOCK_FN=BLOCK_FN, NFUNC=NFUNC,
                    MODE=MODE, HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2,
                    INTERVALS_IN_REGISTERS=INTERVALS_IN_REGISTERS, FAST_SIGMOID=FAST_SIGMOID, FLOOR_SCORES=FLOOR_SCORES,
                    DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V,
                    TILE_QK=TILE_QK, TILE_V=TILE_V, BIAS=BIAS, BROWS=brows, HAS_BIAS=HAS_BIAS, WIDE_TIMES=copy == 1,
                    RAB=RAB, RAB_BASE=rab_b, HAS_RAB=HAS_RAB)
        acc = acc * out_scale
        if HAS_ROW_SCALE:
            acc = acc * tl.load(ROW_SCALE + rows_g, mask=row_ok, other=0.0)[:, None]
        store_rows(OUT, rows_g, row_ok, h, acc, OUT_DIM, OUT_TILE)
