"""Forward: one program per (query block, head); ``O = silu(alpha Q K^T) * M V / scaling``."""

from __future__ import annotations

import triton
import triton.language as tl

from .query_major import key_block_scores, query_major_program
from .silu import sigmoid


@triton.jit
def attend(q, do, K, V, h, seq_start, L, n0, rows, alpha, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr,
           DIM_V: tl.constexpr, TILE_QK: tl.constexpr, TILE_V: tl.constexpr, CAUSAL_MASK: tl.constexpr,
           FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr, BIAS=None, BROWS=None,
           HAS_BIAS: tl.constexpr = False, WIDE_TIMES: tl.constexpr = False, RAB=None, RAB_BASE=None,
           HAS_RAB: tl.constexpr = False, SCALES=None, QSC=None, HAS_SCALES: tl.constexpr = False):
    """Key block ``n0``: ``(silu(alpha q k^T [+ bias]), v)``, the silu zeroed above the diagonal when CAUSAL_MASK;
    with HAS_SCALES (e4m3 inputs, ``key_block_scores``) the silu times the keys' ``v`` scales, ``v`` left in e4m3.

    ``do`` is unused (the dQ kernel's block function takes it). With HAS_BIAS the relative bias
    (``BIAS``: ``bias.Bias``; ``BROWS``: the program's ``bias_rows``) is added to the scores, with the int64
    path for wide chunks compiled in when WIDE_TIMES (``bias.add_bias``); with HAS_RAB the dense bias (``RAB``,
    ``RAB_BASE``: ``rab_tiles``).
    """
    cols, _, v, s = key_block_scores(q, K, V, h, seq_start, L, n0, rows, alpha, BLOCK_N, DIM_QK, DIM_V, TILE_QK,
                                     TILE_V, FLOOR_SCORES, DOT_PRECISION, BIAS, BROWS, HAS_BIAS, WIDE_TIMES, RAB,
                                     RAB_BASE, HAS_RAB, SCALES, QSC, HAS_SCALES)
    p = s * sigmoid(s, FAST_SIGMOID)
    if CAUSAL_MASK:
        p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
    if HAS_SCALES:
        p = p * tl.load(SCALES.v + (seq_start + cols) * SCALES.stride_t + h, mask=cols < L, other=0.0)[None, :]
    return p, v


@triton.jit
def hstu_forward_kernel(
    Q, K, V, OUT, func, rule, OFFS, QTAB, n_flat,
    alpha, out_scale,  # out_scale = 1 / scaling_seqlen, or 1 with ATTN_SCALE
    ATTN_SCALE, HAS_ATTN_SCALE: tl.constexpr,
    NFUNC: tl.constexpr, MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, INTERVALS_POW2: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FLOOR_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, DIM_V: tl.constexpr,
    TILE_QK: tl.constexpr, TILE_V: tl.constexpr,
    BIAS=None, HAS_BIAS: tl.constexpr = False, RAB=None, HAS_RAB: tl.constexpr = False,
):
    """``Q``, ``K``: ``Jagged (total, H, DIM_QK)``; ``V``, ``OUT``: ``Jagged (total, H, DIM_V)``;
    ``func``: ``Func``; ``rule``: ``RuleArgs``; ``ATTN_SCALE``: float32 ``(total,)``, each output row's
    factor (read when HAS_ATTN_SCALE); ``BIAS``: ``bias.Bias``, added to the scores when HAS_BIAS; ``RAB``:
    ``rab_tiles.Rab``, added when HAS_RAB; grid ``(n_flat, H)``."""
    query_major_program(
        Q=Q, DO=Q, K=K, V=V, OUT=OUT, func=func, rule=rule, OFFS=OFFS, QTAB=QTAB, n_flat=n_flat, alpha=alpha,
        out_scale=out_scale, ROW_SCALE=ATTN_SCALE, HAS_ROW_SCALE=HAS_ATTN_SCALE, BLOCK_FN=attend, WITH_DO=False,
        NFUNC=NFUNC, MODE=MODE, HAS_TARGETS=HAS_TARGETS, INTERVALS_POW2=INTERVALS_POW2, FAST_SIGMOID=FAST_SIGMOID,
        FLOOR_SCORES=FLOOR_SCORES,
        DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DIM_QK=DIM_QK, DIM_V=DIM_V, TILE_QK=TILE_QK,
        TILE_V=TILE_V, BIAS=BIAS, HAS_BIAS=HAS_BIAS, RAB=RAB, HAS_RAB=HAS_RAB)
