"""Backward, split to avoid atomics on the common path: a query-major kernel for dQ and a
key-major one for dK, dV.

With ``s = alpha q.k``, ``sig = sigmoid(s)``, ``m`` the mask and ``c = 1/scaling``::

    dV = c * (silu(s) m)^T dO
    dS = c * (dO V^T) * silu'(s) * m,   silu'(s) = sig (1 + s (1 - sig))
    dQ = alpha dS K,   dK = alpha dS^T Q

A key block seen by very many query blocks (a global prefix under SLA) would
make one key-major program walk the whole sequence; its query range is cut into
pieces of ``chunk`` query blocks whose partial dK, dV are added atomically into
zero-initialised outputs. The key block's own program takes the first piece;
the others are items of a list built on the device (``block_plan.SplitList``),
taken by ``n_workers`` programs per head that the grid schedules first, so the
long walks start early and no program waits on an empty slot. Key blocks with at
most ``chunk`` query blocks are written by one program with plain stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bias_tiles import add_bias, bias_cols, bias_grad, row_span, tile_buckets
from .block_tables import first_block, locate_block
from .hulls import block_is_full, interval_visibility
from .memory import load_rows, store_rows, tile_mask, tile_ptrs
from .query_major import key_block_scores, query_major_program
from .rab_tiles import add_rab, rab_base, store_rab_grad
from .row_intervals import MODE_CAUSAL, MODE_FUNC, causal_bounds, head_func, sequence_targets
from .silu import finite_below, sigmoid


@triton.jit
def dq_block(q, do, K, V, h, seq_start, L, n0, rows, alpha, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr,
             DIM_V: tl.constexpr, TILE_QK: tl.constexpr, TILE_V: tl.constexpr, CAUSAL_MASK: tl.constexpr,
             FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr, BIAS=None, BROWS=None,
             HAS_BIAS: tl.constexpr = False, WIDE_TIMES: tl.constexpr = False, RAB=None, RAB_BASE=None,
             HAS_RAB: tl.constexpr = False, SCALES=None, QSC=None, HAS_SCALES: tl.constexpr = False):
    """Key block ``n0``: ``(dS / c, k)`` with ``dS / c = (do v^T) silu'(s)``, zeroed above the diagonal
    when CAUSAL_MASK; ``s`` includes the relative bias when HAS_BIAS and the dense one when HAS_RAB (as
    ``attend``). ``SCALES``, ``QSC``, HAS_SCALES: the forward's e4m3 inputs, which the backward never takes."""
    tl.static_assert(not HAS_SCALES, "the backward takes no e4m3 inputs")
    cols, k, v, s = key_block_scores(q, K, V, h, seq_start, L, n0, rows, alpha, BLOCK_N, DIM_QK, DIM_V, TILE_QK,
                                     TILE_V, FLOOR_SCORES, DOT_PRECISION, BIAS, BROWS, HAS_BIAS, WIDE_TIMES, RAB,
                                     RAB_BASE, HAS_RAB)
    sig = sigmoid(s, FAST_SIGMOID)
    ds = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) * sig * (1.0 + s * (1.0 - sig))
    if CAUSAL_MASK:
        ds = tl.where(cols[None, :] <= rows[:, None], ds, 0.0)
    return ds, k


@triton.jit
def hstu_backward_dq_kernel(
    Q, K, V, DO, DQ, func, rule, OFFS, QTAB, n_flat,
    alpha, dq_scale,  # dq_scale = alpha / scaling, or alpha with ATTN_SCALE
    ATTN_SCALE, HAS_ATTN_SCALE: tl.constexpr,
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, INTERVALS_POW2: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, DIM_V: tl.constexpr,
    TILE_QK: tl.constexpr, TILE_V: tl.constexpr,
    BIAS=None, HAS_BIAS: tl.constexpr = False, RAB=None, HAS_RAB: tl.constexpr = False,
):
    """``Q``, ``K``, ``DQ``: ``Jagged (total, H, DIM_QK)``; ``V``, ``DO``: ``Jagged (total, H, DIM_V)``;
    ``ATTN_SCALE``: float32 ``(total,)``, each query row's factor of dS (read when HAS_ATTN_SCALE);
    ``BIAS``: ``bias.Bias``, added to the scores when HAS_BIAS, ``RAB`` (``rab_tiles.Rab``) when HAS_RAB (their
    gradients come from the dK/dV kernel); grid ``(n_flat, H)``."""
    query_major_program(
        Q=Q, DO=DO, K=K, V=V, OUT=DQ, func=func, rule=rule, OFFS=OFFS, QTAB=QTAB, n_flat=n_flat, alpha=alpha,
        out_scale=dq_scale, ROW_SCALE=ATTN_SCALE, HAS_ROW_SCALE=HAS_ATTN_SCALE, BLOCK_FN=dq_block, WITH_DO=True,
        NFUNC=NFUNC, MODE=MODE, HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2, FAST_SIGMOID=FAST_SIGMOID,
        FLOOR_SCORES=FLOOR_SCORES,
        DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V, TILE_QK=TILE_QK,
        TILE_V=TILE_V, BIAS=BIAS, HAS_BIAS=HAS_BIAS, RAB=RAB, HAS_RAB=HAS_RAB)


@triton.jit
def hstu_backward_dkdv_kernel(
    Q, K, V, DO, DK, DV, func, rule, OFFS, KTAB, BOUNDS, QLO, QHI,
    ITEM_KB, ITEM_LO, ITEM_HI, NITEMS, item_cap, n_workers, n_heads,
    plan_head, n_qblocks, n_kblocks, chunk,
    alpha, dk_scale, dv_scale,  # alpha / scaling, 1 / scaling (alpha, 1 with ATTN_SCALE)
    ATTN_SCALE, HAS_ATTN_SCALE: tl.constexpr,
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, INTERVALS_POW2: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, DIM_V: tl.constexpr,
    TILE_QK: tl.constexpr, TILE_V: tl.constexpr,
    BIAS=None, HAS_BIAS: tl.constexpr = False, BIAS_GRAD: tl.constexpr = False, WIDE_PASS: tl.constexpr = False,
    RAB=None, DRAB=None, HAS_RAB: tl.constexpr = False, RAB_GRAD: tl.constexpr = False,
    RAB_SHARED: tl.constexpr = False,
):
    """1-D grid ``(n_workers + n_kblocks) * n_heads``: first ``n_workers`` programs per head (heads
    interleaved), each taking every ``n_workers``-th item of the head's split list (``ITEM_KB``, ``ITEM_LO``,
    ``ITEM_HI``: ``(Hplan, item_cap)``, ``NITEMS``: their count), then one program per (head, key block),
    which walks the first ``chunk`` query blocks of its range, or all of it when no longer; ``BOUNDS``,
    ``QLO``, ``QHI``: ``_plan_kernel``'s output (unused under MODE_CAUSAL); ``plan_head`` is 1 when the plan
    has one row per head;
    ``ATTN_SCALE``: float32 ``(total,)``, each query row's factor of A and dS (read when HAS_ATTN_SCALE).
    ``BIAS``: ``bias.Bias``, added to the scores when HAS_BIAS; with BIAS_GRAD each tile's ``dS`` is also
    reduced into the tables' gradient buffers (``bias.bias_grad``). With a bias the kernel is launched twice
    (``launch.bias_passes``): WIDE_PASS False runs the key blocks of sequences without a wide chunk, True those
    with one, with the int64 path compiled in (``bias_tiles.add_bias``); the other programs return at once.
    Two launches rather than two copies of the loop: the common copy does not carry the wide one's
    registers, which spill at 255 a thread.
    ``RAB``: ``rab_tiles.Rab``, a dense bias added to the scores when HAS_RAB; with RAB_GRAD each pair's ``dS``
    is written into ``DRAB`` (float32, ``rab_tiles.Rab`` of a zeroed buffer), added atomically when
    RAB_SHARED (one bias row for every head)."""
    pid = tl.program_id(0)
    worker = pid < n_workers * n_heads
    if worker:  # every n_workers-th item of its head's list
        h = pid % n_heads
        hp = h * plan_head
        for w in range(pid // n_heads, tl.load(NITEMS + hp), n_workers):
            item = hp.to(tl.int64) * item_cap + w
            _key_block(Q, K, V, DO, DK, DV, func, rule, OFFS, KTAB, BOUNDS, QLO, QHI, tl.load(ITEM_LO + item),
                       tl.load(ITEM_HI + item), True, tl.load(ITEM_KB + item), h, plan_head, n_qblocks, n_kblocks,
                       chunk, alpha, dk_scale, dv_scale, ATTN_SCALE, HAS_ATTN_SCALE, NFUNC, MODE, HAS_TARGETS,
                       INTERVALS_POW2, FAST_SIGMOID, FLOOR_SCORES, DOT_PRECISION, BLOCK_M, BLOCK_N, DIM_QK, DIM_V,
                       TILE_QK, TILE_V,
                       BIAS, HAS_BIAS, BIAS_GRAD, WIDE_PASS, RAB, DRAB, HAS_RAB, RAB_GRAD, RAB_SHARED)
    else:  # a key block: the first piece of its range
        r = pid - n_workers * n_heads
        _key_block(Q, K, V, DO, DK, DV, func, rule, OFFS, KTAB, BOUNDS, QLO, QHI, 0, 0, False, r % n_kblocks,
                   r // n_kblocks, plan_head, n_qblocks, n_kblocks, chunk, alpha, dk_scale, dv_scale, ATTN_SCALE,
                   HAS_ATTN_SCALE, NFUNC, MODE, HAS_TARGETS, INTERVALS_POW2, FAST_SIGMOID, FLOOR_SCORES,
                   DOT_PRECISION, BLOCK_M,
                   BLOCK_N, DIM_QK, DIM_V, TILE_QK, TILE_V, BIAS, HAS_BIAS, BIAS_GRAD, WIDE_PASS, RAB, DRAB, HAS_RAB,
                   RAB_GRAD, RAB_SHARED)


@triton.jit
def _key_block(Q, K, V, DO, DK, DV, func, rule, OFFS, KTAB, BOUNDS, QLO, QHI, item_lo, item_hi, WORKER: tl.constexpr,
               kflat, h,
               plan_head, n_qblocks, n_kblocks, chunk, alpha, dk_scale, dv_scale, ATTN_SCALE,
               HAS_ATTN_SCALE: tl.constexpr, NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr,
               INTERVALS_POW2: tl.constexpr, FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr,
               DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, DIM_V: tl.constexpr,
               TILE_QK: tl.constexpr, TILE_V: tl.constexpr, BIAS, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
               WIDE_PASS: tl.constexpr, RAB, DRAB, HAS_RAB: tl.constexpr, RAB_GRAD: tl.constexpr,
               RAB_SHARED: tl.constexpr):
    """dK, dV of key block ``kflat`` over one piece of its query range: a worker's item ``[item_lo, item_hi)``
    (WORKER), or the key block's own program's first piece (the whole range when it holds at most ``chunk`` query
    blocks, written with plain stores; else added atomically, as every worker's piece). Two copies in the kernel:
    the key blocks' carries no loop state of the workers (at 255 registers, each live value spills)."""
    seq, kb, seq_start, L = locate_block(KTAB, OFFS, kflat, BLOCK_N)
    live = kb * BLOCK_N < L
    if HAS_BIAS:  # this launch's sequences only (launch.bias_passes)
        live = live & (tl.load(BIAS.seq_wide + seq) == (1 if WIDE_PASS else 0))
    if live:
        targets = sequence_targets(rule, seq, HAS_TARGETS)
        n0 = kb * BLOCK_N
        n1 = tl.minimum(n0 + BLOCK_N, L)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        cols_g = seq_start + cols
        func_h = head_func(func, h)  # a new name: the tuple's field types differ
        if MODE == MODE_CAUSAL:
            q_lo = n0 // BLOCK_M
            q_hi = (L + BLOCK_M - 1) // BLOCK_M
        else:
            q_lo = tl.load(QLO + h * plan_head * n_kblocks + kflat)
            q_hi = tl.load(QHI + h * plan_head * n_kblocks + kflat)
        if WORKER:
            is_split = True
            lo = item_lo
            hi = item_hi
        else:
            is_split = q_hi - q_lo > chunk
            lo = q_lo
            hi = tl.where(is_split, tl.minimum(q_hi, q_lo + chunk), q_hi)
        jr = tl.arange(0, INTERVALS_POW2)
        k = load_rows(K, cols_g, col_ok, h, DIM_QK, TILE_QK)
        v = load_rows(V, cols_g, col_ok, h, DIM_V, TILE_V)
        q_flat = first_block(OFFS, seq, BLOCK_M)
        acc_k = tl.zeros((BLOCK_N, TILE_QK), dtype=tl.float32)
        acc_v = tl.zeros((BLOCK_N, TILE_V), dtype=tl.float32)
        if HAS_BIAS:
            bi, bmin, bmax, base_b = bias_cols(BIAS, seq, seq_start, L, cols, n0)
        if HAS_RAB:
            rab_b = rab_base(RAB, seq, h)
        if RAB_GRAD:
            drab_b = rab_base(DRAB, seq, h)
        for qb in range(lo, hi):
            m0 = qb * BLOCK_M
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < L
            rows_g = seq_start + rows
            q = load_rows(Q, rows_g, row_ok, h, DIM_QK, TILE_QK)
            do = load_rows(DO, rows_g, row_ok, h, DIM_V, TILE_V)
            if MODE == MODE_CAUSAL:
                hlo, hhi, clo, chi = causal_bounds(m0, L, BLOCK_M, INTERVALS_POW2)
            else:
                b = BOUNDS + ((h * plan_head * n_qblocks) + q_flat + qb) * 4 * INTERVALS_POW2 + jr
                hlo = tl.load(b)
                hhi = tl.load(b + INTERVALS_POW2)
                clo = tl.load(b + 2 * INTERVALS_POW2)
                chi = tl.load(b + 3 * INTERVALS_POW2)
            s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * alpha  # (BLOCK_N, BLOCK_M): S^T
            if HAS_BIAS:
                amin, amax, base_a = row_span(BIAS, seq, seq_start, m0, BLOCK_M)
                d = base_a - base_b
                b_lo, b_hi, sgn = tile_buckets(BIAS, amin, amax, bmin, bmax, d)
                if m0 < L:  # always: keeps the pipeliner off the bias loads (bias.PIPELINE_GUARD)
                    s = add_bias(s, BIAS, h, seq_start, L, rows, cols, 0, bi, d, b_lo, b_hi, sgn, True,
                                 WIDE_PASS, DOT_PRECISION)
            if HAS_RAB:
                s = add_rab(s, RAB, rab_b, L, rows, cols, True)
            if FLOOR_SCORES:
                s = finite_below(s)
            sig = sigmoid(s, FAST_SIGMOID)
            p = s * sig
            dsilu = sig * (1.0 + s * (1.0 - sig))
            if HAS_ATTN_SCALE:
                row_scale = tl.load(ATTN_SCALE + rows_g, mask=row_ok, other=0.0)[None, :]
                p = p * row_scale
                dsilu = dsilu * row_scale
            # Both operands of the coming dots are cast now, before dP is computed: fewer registers live
            # at once (s and sig die here), which keeps this kernel from spilling.
            p = p.to(do.dtype)
            dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds = dp * dsilu
            if RAB_GRAD:
                ds32 = ds  # the dense bias's gradient, from float32 dS
            ds = ds.to(q.dtype)
            if not block_is_full(n0, n1, clo, chi):
                # Intervals are re-read here rather than held in registers: along this kernel's
                # transposed tile a row vector costs ~16 registers a thread (measured slower).
                if MODE == MODE_CAUSAL:
                    vis = cols[:, None] <= rows[None, :]
                else:
                    vis = interval_visibility(
                        func=func_h, targets=targets, rule=rule, rows=rows, rows_g=rows_g, row_ok=row_ok,
                        L=L, cols=cols, n0=n0, hlo=hlo, hhi=hhi, NFUNC=NFUNC, MODE=MODE,
                        HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2, BLOCK_N=BLOCK_N, TRANS=True)
                p = tl.where(vis, p, 0.0)
                ds = tl.where(vis, ds, 0.0)
                if RAB_GRAD:
                    ds32 = tl.where(vis, ds32, 0.0)
            if RAB_GRAD:
                store_rab_grad(DRAB, drab_b, L, rows, cols, ds32 * dv_scale, True, RAB_SHARED)
            if BIAS_GRAD:
                bias_grad(BIAS, h, seq_start, L, ds, rows, cols, 0, bi, d, b_lo, b_hi, sgn, dv_scale,
                          DOT_PRECISION, True, WIDE_PASS, MODE == MODE_FUNC)
            acc_v += tl.dot(p, do, input_precision=DOT_PRECISION)
            acc_k += tl.dot(ds, q, input_precision=DOT_PRECISION)
        dk_ptrs = tile_ptrs(DK, cols_g, h, TILE_QK)
        dv_ptrs = tile_ptrs(DV, cols_g, h, TILE_V)
        dk_mask = tile_mask(col_ok, DIM_QK, TILE_QK)
        dv_mask = tile_mask(col_ok, DIM_V, TILE_V)
        if is_split:
            tl.atomic_add(dk_ptrs, (acc_k * dk_scale).to(DK.ptr.dtype.element_ty), mask=dk_mask, sem="relaxed")
            tl.atomic_add(dv_ptrs, (acc_v * dv_scale).to(DV.ptr.dtype.element_ty), mask=dv_mask, sem="relaxed")
        else:
            tl.store(dk_ptrs, (acc_k * dk_scale).to(DK.ptr.dtype.element_ty), mask=dk_mask)
            tl.store(dv_ptrs, (acc_v * dv_scale).to(DV.ptr.dtype.element_ty), mask=dv_mask)


@triton.jit
def zero_split_rows_kernel(OFFS, KTAB, QLO, QHI, DK, DV, n_kblocks, n_heads, chunk, PER_HEAD: tl.constexpr,
                           CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr,
                           DIM_V: tl.constexpr, TILE_QK: tl.constexpr, TILE_V: tl.constexpr):
    """Grid ``(n_kblocks, Hplan)``: zero the dK, dV rows of every key block whose query range holds more than
    ``chunk`` query blocks (the test of ``_key_block``'s own program), which the dK/dV kernel then adds into
    atomically; every other row it stores whole, so only these rows need zeros (a plan row serves every head
    unless PER_HEAD)."""
    kflat = tl.program_id(0)
    hp = tl.program_id(1)
    _, kb, seq_start, L = locate_block(KTAB, OFFS, kflat, BLOCK_N)
    if kb * BLOCK_N < L:
        if CAUSAL:
            q_lo = kb * BLOCK_N // BLOCK_M
            q_hi = (L + BLOCK_M - 1) // BLOCK_M
        else:
            q_lo = tl.load(QLO + hp * n_kblocks + kflat)
            q_hi = tl.load(QHI + hp * n_kblocks + kflat)
        if q_hi - q_lo > chunk:
            cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = cols < L
            h_lo = hp if PER_HEAD else 0
            h_hi = hp + 1 if PER_HEAD else n_heads
            for h in range(h_lo, h_hi):
                store_rows(DK, seq_start + cols, ok, h, tl.zeros((BLOCK_N, TILE_QK), tl.float32), DIM_QK, TILE_QK)
                store_rows(DV, seq_start + cols, ok, h, tl.zeros((BLOCK_N, TILE_V), tl.float32), DIM_V, TILE_V)
