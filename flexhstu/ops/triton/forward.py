"""Forward: one program per (query block, head); ``O = silu(alpha Q K^T) * M V / scaling``."""

from __future__ import annotations

import triton
import triton.language as tl

from .query_major import query_major_walk
from .silu import sigmoid
from .tables import locate_block


@triton.jit
def attend(q, do, K, V, h, seq_start, L, n0, rows, stride_kt, stride_kh, stride_vt, stride_vh, alpha,
           BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, CAUSAL_MASK: tl.constexpr, FAST: tl.constexpr):
    """Key block ``n0``: ``(silu(alpha q k^T), v)`` (``do`` unused), the silu zeroed above the diagonal when CAUSAL_MASK."""
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
        acc = query_major_walk(acc, q, q, K, V, FUNC, NT, h, seq, seq_start, L, m0, rows, row_ok, rows_g,
                               stride_kt, stride_kh, stride_vt, stride_vh, stride_fh, stride_fj, stride_ft, fx_c, fx_w, fx_f,
                               alpha, attend, NFUNC, MODE, HAS_T, RP, FAST, HOIST, BLOCK_M, BLOCK_N, DQK, DV)
        out = acc * out_scale
        tl.store(O + rows_g[:, None] * stride_ot + h * stride_oh + tl.arange(0, DV)[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None])
