"""The query-major walk shared by the forward and the dQ kernel.

One program owns a query block and visits the key blocks its rows see: under
MODE_CAUSAL two loops (blocks wholly before the first row, then the diagonal
blocks), otherwise the merged interval hulls of the block, masking only the key
blocks that no core covers. ``BLOCK_FN`` computes one key block's contribution
as a pair ``(x, y)`` (forward: ``(silu(s), v)``; dQ: ``(dS / c, k)``), added as
``acc += x @ y``; the walk zeroes ``x`` where the mask hides a pair.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .plan import block_bounds, block_is_full, bounds4, interval_visibility, kv_block_at, kv_ranges, load_intervals4, mask4


@triton.jit
def query_major_walk(acc, q, do, K, V, FUNC, NT, h, seq, seq_start, L, m0, rows, row_ok, rows_g,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_fh, stride_fj, stride_ft, fx_c, fx_w, fx_f, alpha,
                     BLOCK_FN: tl.constexpr, NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_T: tl.constexpr,
                     RP: tl.constexpr, FAST: tl.constexpr, HOIST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr):
    if MODE == 1:
        # Causal: key blocks wholly at or before the first row need no mask; the rest meet the diagonal.
        n_full = (m0 + 1) // BLOCK_N
        n_end = (tl.minimum(m0 + BLOCK_M, L) + BLOCK_N - 1) // BLOCK_N
        for kb in range(0, n_full):
            x, y = BLOCK_FN(q, do, K, V, h, seq_start, L, kb * BLOCK_N, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                            alpha, BLOCK_N, DQK, DV, False, FAST)
            acc += tl.dot(x.to(y.dtype), y)
        for kb in range(n_full, n_end):
            x, y = BLOCK_FN(q, do, K, V, h, seq_start, L, kb * BLOCK_N, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                            alpha, BLOCK_N, DQK, DV, True, FAST)
            acc += tl.dot(x.to(y.dtype), y)
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
            x, y = BLOCK_FN(q, do, K, V, h, seq_start, L, n0, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                            alpha, BLOCK_N, DQK, DV, False, FAST)
            if not block_is_full(n0, tl.minimum(n0 + BLOCK_N, L), clo, chi):
                cols = n0 + tl.arange(0, BLOCK_N)
                if HOIST:
                    vis = mask4(s0, e0, s1, e1, s2, e2, s3, e3, cols, n0, hlo, hhi, NFUNC, RP, BLOCK_N, False)
                else:
                    vis = interval_visibility(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, cols, L, n0, hlo, hhi,
                                              fx_t, fx_c, fx_w, fx_f, NFUNC, MODE, HAS_T, RP, BLOCK_N, False)
                x = tl.where(vis, x, 0.0)
            acc += tl.dot(x.to(y.dtype), y)
    return acc
