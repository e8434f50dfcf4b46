"""Delta forward: one program per (query block, head) of the query rows, against whole key sequences.

A delta query block is a block of query rows whose local positions start at
``q_start[b] + r0`` instead of ``r0``; the training forward's query-major walk
then visits exactly the key blocks those rows see (hulls, cores and the causal
diagonal are all computed from local positions). Func columns are the query rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_tables import locate_block
from .forward import attend
from .memory import load_rows, store_rows
from .query_major import query_major_walk


@triton.jit
def delta_forward_kernel(
    Q, K, V, OUT, func, rule, OFFS, KVLEN, QOFFS, QSTART, QTAB, n_flat, total_q,
    alpha, out_scale,  # out_scale = 1 / scaling_seqlen
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, INTERVALS_POW2: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, DIM_V: tl.constexpr,
    TILE_QK: tl.constexpr, TILE_V: tl.constexpr, HAS_KVLEN: tl.constexpr, N_SPLITS: tl.constexpr,
    SCALES=None, HAS_SCALES: tl.constexpr = False,
):
    """``Q``: ``Jagged (total_q, H, DIM_QK)`` by ``QOFFS``; ``K``, ``V``: ``Jagged (total_kv, H, D)`` by ``OFFS``
    (with HAS_KVLEN, sequence ``b``'s keys are the first ``KVLEN[b]`` rows from ``OFFS[b]``); ``QSTART (B,)``;
    grid ``(n_flat, H, N_SPLITS)`` over ``QTAB``, the query rows' block table. ``OUT``: ``(N_SPLITS * total_q,
    H, DIM_V)``, zero-filled (rows outside their sequence are never written); split ``s`` writes the sum over its
    key blocks (``query_major_walk``) at rows ``s * total_q + row``, for the caller to add up. With HAS_SCALES,
    ``Q``, ``K``, ``V`` are e4m3 and ``SCALES`` (``args.Fp8Scales``) their rows' scales (``flexhstu.ops.fp8``)."""
    INTERVALS_IN_REGISTERS: tl.constexpr = NFUNC <= 7  # as the training forward (query_major_program)
    h = tl.program_id(1)
    split = tl.program_id(2)
    seq, qb, q_first, nq = locate_block(QTAB, QOFFS, n_flat - 1 - tl.program_id(0), BLOCK_M)
    seq_start = tl.load(OFFS + seq).to(tl.int64)
    L = (tl.load(OFFS + seq + 1) - seq_start).to(tl.int32)
    if HAS_KVLEN:  # clamped to the slot: a bad length (not checked on the GPU) never reads another sequence
        L = tl.minimum(tl.maximum(tl.load(KVLEN + seq).to(tl.int32), 0), L)
    r0 = qb * BLOCK_M
    m0 = tl.load(QSTART + seq).to(tl.int32) + r0  # local position of the block's first row
    # m0 < L also bounds the causal walk when q_start is garbage (it is not checked on the GPU).
    if (r0 < nq) & (m0 < L):
        r = r0 + tl.arange(0, BLOCK_M)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = (r < nq) & (rows >= 0) & (rows < L)
        qrows_g = q_first + r
        q = load_rows(Q, qrows_g, row_ok, h, DIM_QK, TILE_QK)
        # With e4m3 inputs, alpha times each row's scale multiplies its scores (key_block_scores).
        qsc = tl.load(SCALES.q + qrows_g * SCALES.stride_t + h, mask=row_ok, other=0.0) * alpha if HAS_SCALES else None
        acc = query_major_walk(
            acc=tl.zeros((BLOCK_M, TILE_V), dtype=tl.float32), q=q, do=q, K=K, V=V, func=func, rule=rule, h=h,
            seq=seq, seq_start=seq_start, L=L, m0=m0, rows=rows, row_ok=row_ok, rows_g=qrows_g, alpha=alpha,
            BLOCK_FN=attend, NFUNC=NFUNC, MODE=MODE, HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2,
            INTERVALS_IN_REGISTERS=INTERVALS_IN_REGISTERS, FAST_SIGMOID=FAST_SIGMOID, FLOOR_SCORES=FLOOR_SCORES,
            DOT_PRECISION=DOT_PRECISION,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V, TILE_QK=TILE_QK, TILE_V=TILE_V,
            SPLIT=split, N_SPLITS=N_SPLITS, SCALES=SCALES, QSC=qsc, HAS_SCALES=HAS_SCALES)
        store_rows(OUT, split.to(tl.int64) * total_q + qrows_g, row_ok, h, acc * out_scale, DIM_V, TILE_V)
