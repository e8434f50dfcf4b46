"""Forward: one program per (query block, head); ``O = silu(alpha Q K^T) * M V / scaling``."""

from __future__ import annotations

import triton
import triton.language as tl

from .plan import (block_bounds, block_is_full, bounds4, interval_visibility, kv_block_at, kv_ranges, load_intervals4,
                   locate_block, mask4, sigmoid)


@triton.jit
def attend(q, K, V, h, seq_start, L, n0, rows, stride_kt, stride_kh, stride_vt, stride_vh, alpha,
           BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, CAUSAL_MASK: tl.constexpr, FAST: tl.constexpr):
    """Key block ``n0``: ``(silu(alpha q k^T), v)``, the silu zeroed above the diagonal when CAUSAL_MASK."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    cols_g = seq_start + cols
    k = tl.load(K + cols_g[:, None] * stride_kt + h * stride_kh + tl.arange(0, DQK)[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + cols_g[:, None] * stride_vt + h * stride_vh + tl.arange(0, DV)[None, :], mask=col_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * alpha
    p = s * sigmoid(s, FAST)
    if CAUSAL_MASK:
        p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
    return p, v


@triton.jit
def hstu_forward_kernel(
    Q, K, V, O, FUNC, OFFS, NT, QTAB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_fh, stride_fj, stride_ft, n_flat, fx_c, fx_w, fx_f,
    alpha, out_scale,  # out_scale = 1 / scaling_seqlen
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr, FAST: tl.constexpr, HOIST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
):
    # Last flat blocks first: under causal-like masks they carry the most key blocks.
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
        acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
        if MODE == 1:
            # Causal: key blocks wholly at or before the first row need no mask; the rest meet the diagonal.
            n_full = (m0 + 1) // BLOCK_N
            n_end = (tl.minimum(m0 + BLOCK_M, L) + BLOCK_N - 1) // BLOCK_N
            for kb in range(0, n_full):
                p, v = attend(q, K, V, h, seq_start, L, kb * BLOCK_N, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                              alpha, BLOCK_N, DQK, DV, False, FAST)
                acc += tl.dot(p.to(v.dtype), v)
            for kb in range(n_full, n_end):
                p, v = attend(q, K, V, h, seq_start, L, kb * BLOCK_N, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                              alpha, BLOCK_N, DQK, DV, True, FAST)
                acc += tl.dot(p.to(v.dtype), v)
        else:
            fx_t = 0
            if HAS_T:
                fx_t = tl.load(NT + seq).to(tl.int32)
            fbase = FUNC + h * stride_fh
            if HOIST:
                s0, e0, s1, e1, s2, e2, s3, e3 = load_intervals4(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L,
                                                                 fx_t, fx_c, fx_w, fx_f, NFUNC, MODE, HAS_T)
                hlo, hhi, clo, chi = bounds4(s0, e0, s1, e1, s2, e2, s3, e3, row_ok, NFUNC, RP)
            else:
                hlo, hhi, clo, chi = block_bounds(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, fx_t, fx_c, fx_w, fx_f,
                                                  NFUNC, MODE, HAS_T, RP)
            kstart, klen, kcum = kv_ranges(hlo, hhi, BLOCK_N, RP)
            for it in range(tl.sum(klen, axis=0)):
                n0 = kv_block_at(it, kstart, klen, kcum) * BLOCK_N
                p, v = attend(q, K, V, h, seq_start, L, n0, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                              alpha, BLOCK_N, DQK, DV, False, FAST)
                if not block_is_full(n0, tl.minimum(n0 + BLOCK_N, L), clo, chi):
                    cols = n0 + tl.arange(0, BLOCK_N)
                    if HOIST:
                        vis = mask4(s0, e0, s1, e1, s2, e2, s3, e3, cols, n0, hlo, hhi, NFUNC, RP, BLOCK_N, False)
                    else:
                        vis = interval_visibility(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, cols, L, n0, hlo, hhi,
                                                  fx_t, fx_c, fx_w, fx_f, NFUNC, MODE, HAS_T, RP, BLOCK_N, False)
                    p = tl.where(vis, p, 0.0)
                acc += tl.dot(p.to(v.dtype), v)
        out = acc * out_scale
        tl.store(O + rows_g[:, None] * stride_ot + h * stride_oh + tl.arange(0, DV)[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None])
