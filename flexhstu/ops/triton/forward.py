"""Forward: one program per (query block, head); ``O = silu(alpha Q K^T) * M V / scaling``."""

from __future__ import annotations

import triton
import triton.language as tl

from .plan import block_bounds, block_is_full, causal_bounds, interval_visibility, kv_block_at, kv_ranges, locate_block


@triton.jit
def hstu_forward_kernel(
    Q, K, V, O, FUNC, OFFS, NT, QTAB, QCUM,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_fh, stride_fj, stride_ft, nseq, n_flat, fx_c, fx_w, fx_f,
    scale_log2,  # alpha * log2(e): S is kept in base-2 units so the sigmoid is one exp2
    out_scale,   # 1 / (log2(e) * scaling_seqlen)
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr, RP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
):
    # Last flat blocks first: under causal-like masks they carry the most key blocks.
    pid = n_flat - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq, qb = locate_block(QTAB, QCUM, pid, nseq)
    if seq < nseq:
        seq_start = tl.load(OFFS + seq).to(tl.int64)
        L = (tl.load(OFFS + seq + 1) - seq_start).to(tl.int32)
        fx_t = 0
        if HAS_T:
            fx_t = tl.load(NT + seq).to(tl.int32)
        m0 = qb * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        rows_g = seq_start + rows
        fbase = FUNC + h * stride_fh
        if MODE == 1:
            hlo, hhi, clo, chi = causal_bounds(m0, L, BLOCK_M, RP)
        else:
            hlo, hhi, clo, chi = block_bounds(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, fx_t, fx_c, fx_w, fx_f,
                                              NFUNC, MODE, HAS_T, RP)
        kstart, klen, kcum = kv_ranges(hlo, hhi, BLOCK_N, RP)
        n_iter = tl.sum(klen, axis=0)

        dqk = tl.arange(0, DQK)
        dv = tl.arange(0, DV)
        q = tl.load(Q + rows_g[:, None] * stride_qt + h * stride_qh + dqk[None, :], mask=row_ok[:, None], other=0.0)
        acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
        for it in range(n_iter):
            n0 = kv_block_at(it, kstart, klen, kcum) * BLOCK_N
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < L
            cols_g = seq_start + cols
            k = tl.load(K + cols_g[:, None] * stride_kt + h * stride_kh + dqk[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(V + cols_g[:, None] * stride_vt + h * stride_vh + dv[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            p = s / (1.0 + tl.exp2(-s))  # log2(e) * silu(alpha q.k)
            if not block_is_full(n0, tl.minimum(n0 + BLOCK_N, L), clo, chi):
                vis = interval_visibility(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, cols, L, n0, hlo, hhi,
                                          fx_t, fx_c, fx_w, fx_f, NFUNC, MODE, HAS_T, RP, BLOCK_N, False)
                p = tl.where(vis, p, 0.0)
            acc += tl.dot(p.to(v.dtype), v)
        out = acc * out_scale
        tl.store(O + rows_g[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
