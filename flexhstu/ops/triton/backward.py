"""Backward, split to avoid atomics on the common path: a query-major kernel for dQ and a
key-major one for dK, dV.

With ``s = alpha q.k``, ``sig = sigmoid(s)``, ``m`` the mask and ``c = 1/scaling``::

    dV = c * (silu(s) m)^T dO
    dS = c * (dO V^T) * silu'(s) * m,   silu'(s) = sig (1 + s (1 - sig))
    dQ = alpha dS K,   dK = alpha dS^T Q

A key block seen by very many query blocks (a global prefix under SLA) would
make one key-major program walk the whole sequence; its query range is split
into ``n_split`` chunks whose partial dK, dV are added atomically into
zero-initialised outputs. Key blocks with at most ``chunk`` query blocks are
written by one program with plain stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .plan import block_is_full, interval_visibility
from .query_major import query_major_walk
from .rules import causal_bounds
from .silu import sigmoid
from .tables import first_block, locate_block


@triton.jit
def dq_block(q, do, K, V, h, seq_start, L, n0, rows, stride_kt, stride_kh, stride_vt, stride_vh, alpha,
             BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, CAUSAL_MASK: tl.constexpr, FAST: tl.constexpr):
    """Key block ``n0``: ``(dS / c, k)`` with ``dS / c = (do v^T) silu'(s)``, zeroed above the diagonal when CAUSAL_MASK."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    cols_g = seq_start + cols
    k = tl.load(K + cols_g[:, None] * stride_kt + h * stride_kh + tl.arange(0, DQK)[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + cols_g[:, None] * stride_vt + h * stride_vh + tl.arange(0, DV)[None, :], mask=col_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * alpha
    sig = sigmoid(s, FAST)
    ds = tl.dot(do, tl.trans(v)) * sig * (1.0 + s * (1.0 - sig))
    if CAUSAL_MASK:
        ds = tl.where(cols[None, :] <= rows[:, None], ds, 0.0)
    return ds, k


@triton.jit
def hstu_backward_dq_kernel(
    Q, K, V, DO, DQ, FUNC, OFFS, NT, QTAB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_fh, stride_fj, stride_ft, n_flat, fx_c, fx_w, fx_f,
    alpha, dq_scale,  # dq_scale = alpha / scaling
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr, FAST: tl.constexpr, HOIST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
):
    pid = n_flat - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq, qb = locate_block(QTAB, OFFS, pid, BLOCK_M)
    seq_start = tl.load(OFFS + seq).to(tl.int64)
    L = (tl.load(OFFS + seq + 1) - seq_start).to(tl.int32)
    if qb * BLOCK_M < L:
        m0 = qb * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        rows_g = seq_start + rows
        q = tl.load(Q + rows_g[:, None] * stride_qt + h * stride_qh + tl.arange(0, DQK)[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + rows_g[:, None] * stride_dot + h * stride_doh + tl.arange(0, DV)[None, :], mask=row_ok[:, None], other=0.0)
        acc = tl.zeros((BLOCK_M, DQK), dtype=tl.float32)
        acc = query_major_walk(acc, q, do, K, V, FUNC, NT, h, seq, seq_start, L, m0, rows, row_ok, rows_g,
                               stride_kt, stride_kh, stride_vt, stride_vh, stride_fh, stride_fj, stride_ft, fx_c, fx_w, fx_f,
                               alpha, dq_block, NFUNC, MODE, HAS_T, RP, FAST, HOIST, BLOCK_M, BLOCK_N, DQK, DV)
        tl.store(DQ + rows_g[:, None] * stride_dqt + h * stride_dqh + tl.arange(0, DQK)[None, :],
                 (acc * dq_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def hstu_backward_dkdv_kernel(
    Q, K, V, DO, GRAD_K, GRAD_V, FUNC, OFFS, NT, KTAB, BOUNDS, QLO, QHI,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_fh, stride_fj, stride_ft,
    plan_head, n_qblocks, n_kblocks, n_split, chunk, fx_c, fx_w, fx_f,
    alpha, dk_scale, dv_scale,  # alpha / scaling, 1 / scaling
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr, FAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
):
    pid = tl.program_id(0)
    kflat = pid // n_split
    split = pid % n_split
    h = tl.program_id(1)
    seq, kb = locate_block(KTAB, OFFS, kflat, BLOCK_N)
    seq_start = tl.load(OFFS + seq).to(tl.int64)
    L = (tl.load(OFFS + seq + 1) - seq_start).to(tl.int32)
    if kb * BLOCK_N < L:
        fx_t = 0
        if HAS_T:
            fx_t = tl.load(NT + seq).to(tl.int32)
        n0 = kb * BLOCK_N
        n1 = tl.minimum(n0 + BLOCK_N, L)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        cols_g = seq_start + cols
        fbase = FUNC + h * stride_fh
        if MODE == 1:
            q_lo = n0 // BLOCK_M
            q_hi = (L + BLOCK_M - 1) // BLOCK_M
        else:
            q_lo = tl.load(QLO + h * plan_head * n_kblocks + kflat)
            q_hi = tl.load(QHI + h * plan_head * n_kblocks + kflat)
        is_split = q_hi - q_lo > chunk
        lo = q_lo
        hi = q_hi
        if is_split:
            lo = q_lo + split * chunk
            hi = tl.where(split == n_split - 1, q_hi, tl.minimum(q_hi, lo + chunk))
        if is_split or split == 0:
            dqk = tl.arange(0, DQK)
            dv = tl.arange(0, DV)
            jr = tl.arange(0, RP)
            k = tl.load(K + cols_g[:, None] * stride_kt + h * stride_kh + dqk[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(V + cols_g[:, None] * stride_vt + h * stride_vh + dv[None, :], mask=col_ok[:, None], other=0.0)
            q_flat = first_block(OFFS, seq, BLOCK_M)
            acc_k = tl.zeros((BLOCK_N, DQK), dtype=tl.float32)
            acc_v = tl.zeros((BLOCK_N, DV), dtype=tl.float32)
            for qb in range(lo, hi):
                m0 = qb * BLOCK_M
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < L
                rows_g = seq_start + rows
                q = tl.load(Q + rows_g[:, None] * stride_qt + h * stride_qh + dqk[None, :], mask=row_ok[:, None], other=0.0)
                do = tl.load(DO + rows_g[:, None] * stride_dot + h * stride_doh + dv[None, :], mask=row_ok[:, None], other=0.0)
                if MODE == 1:
                    hlo, hhi, clo, chi = causal_bounds(m0, L, BLOCK_M, RP)
                else:
                    b = BOUNDS + ((h * plan_head * n_qblocks) + q_flat + qb) * 4 * RP + jr
                    hlo = tl.load(b)
                    hhi = tl.load(b + RP)
                    clo = tl.load(b + 2 * RP)
                    chi = tl.load(b + 3 * RP)
                s = tl.dot(k, tl.trans(q)) * alpha  # (BLOCK_N, BLOCK_M): S^T
                sig = sigmoid(s, FAST)
                p = s * sig
                dp = tl.dot(v, tl.trans(do))
                ds = dp * sig * (1.0 + s * (1.0 - sig))
                if not block_is_full(n0, n1, clo, chi):
                    # Intervals are re-read here rather than held in registers: along this kernel's
                    # transposed tile a row vector costs ~16 registers a thread (measured slower).
                    vis = interval_visibility(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, cols, L, n0, hlo, hhi,
                                              fx_t, fx_c, fx_w, fx_f, NFUNC, MODE, HAS_T, RP, BLOCK_N, True)
                    p = tl.where(vis, p, 0.0)
                    ds = tl.where(vis, ds, 0.0)
                acc_v += tl.dot(p.to(do.dtype), do)
                acc_k += tl.dot(ds.to(q.dtype), q)
            dk_ptr = GRAD_K + cols_g[:, None] * stride_dkt + h * stride_dkh + dqk[None, :]
            dv_ptr = GRAD_V + cols_g[:, None] * stride_dvt + h * stride_dvh + dv[None, :]
            if is_split:
                tl.atomic_add(dk_ptr, (acc_k * dk_scale).to(GRAD_K.dtype.element_ty), mask=col_ok[:, None], sem="relaxed")
                tl.atomic_add(dv_ptr, (acc_v * dv_scale).to(GRAD_V.dtype.element_ty), mask=col_ok[:, None], sem="relaxed")
            else:
                tl.store(dk_ptr, (acc_k * dk_scale).to(GRAD_K.dtype.element_ty), mask=col_ok[:, None])
                tl.store(dv_ptr, (acc_v * dv_scale).to(GRAD_V.dtype.element_ty), mask=col_ok[:, None])
