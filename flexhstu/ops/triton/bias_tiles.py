"""The relative attention bias in the Triton kernels: read from the two tables per tile, never an N x N tensor.

The rule is ``flexhstu.ops.bias`` (docs/design.md, section 4)::

    bias(i, j) = pos_w[clamp(j - i + P - 1, 0, 2P - 2)] + ts_w[bucket(next_ts(i) - ts(j))]

The tables, the rows' times and the bucket edges are ``bias_tables.prepare``'s (a ``Bias``, made once per
call): a position table padded so that ``center + j - i`` needs no clamp, the time-bucket table, each row's
int32 time offsets from its chunk's float64 base (NaN for a *wide* chunk) and the edges ``E[k]`` of the buckets.

Per tile (``add_bias``): the relative positions index the padded table directly (one load per pair, in the
score tile's own layout: ``_gather``).
For the time part the tile first bounds its gaps from the min/max of its rows' and keys' times (two
scalars per side from the per-block summaries, ``block_span``: no vector read, no reduction across the
warps), takes the bucket of both ends (``bucket_of``: an estimate from the float64 bits corrected by two edge
loads, exact), and if the tile spans buckets ``b_lo .. b_hi`` compares each pair with the edges between them
only: a tile of one bucket (most tiles of time-sorted events away from the diagonal) costs nothing per
pair, and only a tile of several buckets reads the per-row times of the side that changes from tile to
tile (the keys in the query-major kernels, the query rows in the key-major one). A tile of more than
UNROLLED + 1 buckets (near the diagonal) whose top edge lies below 2^31 - 1, which bounds every gap of it,
takes each pair's bucket directly instead (``_pair_buckets``: the int32 gap, an estimate from its float32
bits, one edge load) and gathers the weight. The bias goes straight into the score tile (no second tile held).

Gradients (``bias_grad``, in the key-major dK/dV kernel, which holds ``dS^T`` of each tile): the bias
gradient of a pair is ``dS`` (the gradient of the pre-silu score, already masked and scaled by the
output scale). The tile is reduced first, then added atomically into float32 buffers:

* time buckets: the tile's total, and for each edge ``k`` in ``b_lo + 1 .. b_hi`` the sum over pairs with
  ``|gap| >= E[k]``; bucket ``b`` receives the difference of consecutive sums (one scalar atomic each); under
  a mask function (PAIR_GRADS), a tile whose pairs take their buckets directly sums per bucket inside each
  warp instead, with one reduction across the warps and one vector atomic per 32 buckets (``_bucket_grads``);
* positions, a sum along the tile's diagonals (``_diagonal_sums``): the tile is cut into ``G x G``
  sub-blocks, one matmul with a constant one-hot matrix gives every sub-block's ``2G - 1`` diagonal
  sums, a second (float32) matmul adds the sub-blocks that lie on the same block diagonal, and the
  ``(NX + NY - 1) x (2G - 1)`` results are added atomically (about 340 atomics for a 128 x 64 tile,
  against 8192 for one atomic per pair). The one-hot products are exact: half-precision dS is
  multiplied exactly with fp32 accumulation, float32 dS uses 3xTF32 (or IEEE dots when TF32 is off).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .bias_tables import CHUNK, INT32_SPAN, SUMMARY_GRAIN, SUMMARY_SLOTS

INT32_SPAN_F = tl.constexpr(float(INT32_SPAN))
INT32_MAX = tl.constexpr(INT32_SPAN)
CHUNK_ROWS = tl.constexpr(CHUNK)
GRAIN = tl.constexpr(SUMMARY_GRAIN)
SLOTS = tl.constexpr(SUMMARY_SLOTS)
_IN_PLACE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
"""Whether ``_gather`` loads through inline PTX (the GPU) or ``tl.load`` (the interpreter)."""
BUCKETS_AT_ONCE = tl.constexpr(32)
"""Buckets whose gradients ``_bucket_grads`` reduces across the warps together (one ``(X, 32)`` float32 tile)."""
UNROLLED = tl.constexpr(2)
"""Bucket edges per tile handled without a loop (time-sorted events: 2.2 on average in the benchmark)."""
PIPELINE_GUARD = None
"""Not a value, a note. The per-tile bias work sits behind a branch that always holds (``n0 < L``,
``m0 < L``): without it Triton's software pipeliner (num_stages > 1, sm_90) turns the tile's gathers (the
position entries, the times, even the loads that depend on the tile's bucket range) into multi-stage
shared-memory copies, which measured 2.5x slower on the H200 than plain loads; and a loop directly in the
main loop's body (the bucket edges beyond UNROLLED) stops it from pipelining the K/V loads at all."""


# ------------------------------------------------------------------------------------------------------------------
# Kernel helpers. ``bias`` is a ``bias_tables.Bias``; rows and cols are local positions; ``h`` the head. A tile's times:
# ``ai`` (its rows' next times) and ``bi`` (its keys' times), int32 offsets from their chunks' bases, whose
# difference is ``d`` (float64).


@triton.jit
def _at(T, seq_start, L, idx):
    """``T`` at local positions ``idx``; positions past the sequence's end read its last row (so they widen no
    range of times)."""
    return tl.load(T + seq_start + tl.minimum(idx, L - 1))


@triton.jit
def block_span(bias, seq, seq_start, p0, BS: tl.constexpr, NEXT: tl.constexpr):
    """The min and max of the int32 times (NEXT: next times) of the ``BS`` rows of sequence ``seq`` from local
    position ``p0`` (a multiple of BS), rows past its end left out: two scalar loads of ``bias.summary``
    (``bias_tables.block_summaries``)."""
    tl.static_assert(BS >= GRAIN and BS <= CHUNK_ROWS, "the relative bias needs tiles of 16 to 256 rows")
    chunk = seq_start // CHUNK_ROWS + seq + p0 // CHUNK_ROWS
    within = p0 - (p0 // CHUNK_ROWS) * CHUNK_ROWS  # p0 % CHUNK (the interpreter has no int % constexpr)
    slot = chunk * SLOTS + (SLOTS - 2 * CHUNK_ROWS // BS) + within // BS
    ptr = bias.summary + slot * 4 + (2 if NEXT else 0)
    return tl.load(ptr), -tl.load(ptr + 1)


@triton.jit
def row_span(bias, seq, seq_start, row0, BS: tl.constexpr):
    """A block of ``BS`` query rows from ``row0``: the min and max of its next times and its chunk's base."""
    amin, amax = block_span(bias, seq, seq_start, row0, BS, True)
    return amin, amax, tl.load(bias.next_base + seq_start + row0)


@triton.jit
def col_span(bias, seq, seq_start, col0, BS: tl.constexpr):
    """A block of ``BS`` keys from ``col0``: the min and max of their times and their chunk's base."""
    bmin, bmax = block_span(bias, seq, seq_start, col0, BS, False)
    return bmin, bmax, tl.load(bias.time_base + seq_start + col0)


@triton.jit
def bias_rows(bias, seq, seq_start, L, rows, row0):
    """A program's query rows (held through its walk): their next times (int32 offsets), their min and max, their
    chunk's base (``row0``: the first row) and ``seq``, what ``query_major_bias`` takes."""
    amin, amax, base = row_span(bias, seq, seq_start, row0, rows.shape[0])
    return _at(bias.next32, seq_start, L, rows), amin, amax, base, seq


@triton.jit
def bias_cols(bias, seq, seq_start, L, cols, col0):
    """A program's keys (held through its walk): their times (int32 offsets), their min and max and their chunk's
    base (``col0``: the first key)."""
    bmin, bmax, base = col_span(bias, seq, seq_start, col0, cols.shape[0])
    return _at(bias.time32, seq_start, L, cols), bmin, bmax, base


@triton.jit
def bucket_of(bias, x):
    """The bucket of a scalar float64 gap ``x >= 0``: an estimate within one of it from the float's bits, then
    one comparison with each neighbouring edge makes it exact.

    The high word of ``max(x, 1)`` is its exponent (biased by 1023) and the top 20 bits of its mantissa ``m``:
    read as a number it is ``e + m`` (in units of 2^20) where ``log2(x) = e + log2(1 + m)``, at most 0.0861
    below (the largest ``log2(1 + m) - m``, at ``m = 1/ln2 - 1``), so ``ln(x) / 0.301`` less at most 0.199
    and float32 rounding (~1e-5): the bucket or the one below, never outside the two edges' correction. Integer
    and float32 arithmetic (an I2F, a multiply, an F2I) where ``tl.log2`` of float32 is a libdevice polynomial
    of ~25 instructions and a branch; ``>= 0`` as ``x >= 1``."""
    LOG2_TO_BUCKET: tl.constexpr = 0.6931471805599453 / 0.301
    hi = (tl.maximum(x, 1.0).to(tl.int64, bitcast=True) >> 32).to(tl.int32)
    b = ((hi - (1023 << 20)).to(tl.float32) * (LOG2_TO_BUCKET / (1 << 20))).to(tl.int32)
    b = tl.minimum(b, bias.num_buckets)
    # Both neighbours at once (one memory round trip): the estimate is b* - 1 or b*, b* + 1 only within float32
    # rounding (~1e-5 of a bucket) below an edge; each comparison corrects one direction.
    below = tl.load(bias.edges + b)
    above = tl.load(bias.edges + b + 1)
    return b + tl.where(x >= above, 1, 0) - tl.where(x < below, 1, 0)


@triton.jit
def tile_buckets(bias, amin, amax, bmin, bmax, d):
    """The buckets ``(b_lo, b_hi)`` of the smallest and largest ``|a - b + d|`` for ``a`` in ``[amin, amax]`` (the
    rows' next times) and ``b`` in ``[bmin, bmax]`` (the keys' times): every pair's bucket lies between; and the
    gaps' common sign ``sgn`` (1: all ``>= 0``, -1: all ``<= 0``, 0: both signs), which lets a pair be compared
    with one threshold per edge instead of two (``_far``)."""
    d = tl.where(d == d, d, 0.0)  # NaN: a wide chunk, whose tiles find their buckets themselves (add_bias)
    lo = (amin - bmax).to(tl.float64) + d
    hi = (amax - bmin).to(tl.float64) + d
    gmin = tl.where(lo >= 0, lo, tl.where(hi <= 0, -hi, 0.0))
    gmax = tl.maximum(hi, -lo)
    sgn = tl.where(lo >= 0, 1, tl.where(hi <= 0, -1, 0))
    return bucket_of(bias, gmin), bucket_of(bias, gmax), sgn


@triton.jit
def _far(bias, k, ai, bi, d, TRANS: tl.constexpr, ONE_SIDED: tl.constexpr):
    """Pairs whose gap ``ai - bi + d`` reaches edge ``k`` in magnitude: ``x = ai - bi`` against two thresholds
    saturated to int32 (every ``x`` lies strictly inside, so saturation keeps each comparison's outcome).
    ONE_SIDED: every gap of the tile is ``>= 0`` (a tile of gaps ``<= 0`` passes ``-ai``, ``-bi``, ``-d``), so
    ``|gap| >= E_k`` is ``x >= E_k - d`` alone (``E_k >= 0``: a gap ``>= 0`` reaches ``-E_k`` only when 0, and
    then reaches ``E_k`` as well)."""
    e = tl.load(bias.edges + k)
    hi = tl.minimum(tl.maximum(e - d, -INT32_SPAN_F), INT32_SPAN_F).to(tl.int32)
    x = ai[None, :] - bi[:, None] if TRANS else ai[:, None] - bi[None, :]
    if ONE_SIDED:
        far = x >= hi
    else:
        lo = tl.minimum(tl.maximum(-e - d, -INT32_SPAN_F), INT32_SPAN_F).to(tl.int32)
        far = (x >= hi) | (x <= lo)
    return far


@triton.jit
def query_major_bias(s, bias, brows, h, seq_start, L, rows, cols, n0, WIDE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """``s + bias`` for a ``(rows, cols)`` tile of a query-major program (keys from ``n0``); ``brows``: the
    program's ``bias_rows``; WIDE, DOT_PRECISION: as ``add_bias``."""
    ai, amin, amax, base_a, seq = brows
    if n0 < L:  # always (walks visit key blocks inside the sequence): see PIPELINE_GUARD
        bmin, bmax, base_b = col_span(bias, seq, seq_start, n0, cols.shape[0])
        d = base_a - base_b
        b_lo, b_hi, sgn = tile_buckets(bias, amin, amax, bmin, bmax, d)
        s = add_bias(s, bias, h, seq_start, L, rows, cols, ai, 0, d, b_lo, b_hi, sgn, False, WIDE, DOT_PRECISION)
    return s


@triton.jit
def _wide_times(bias, seq_start, L, rows, cols):
    """A tile that meets a wide chunk: its rows' next times and its keys' times as int64 vectors, and a range of
    buckets that holds every pair's: the gaps' bounds in float64 (no int64 difference, which could wrap), whose
    rounding the range absorbs by one bucket on each side."""
    ta = _at(bias.next64, seq_start, L, rows)
    tb = _at(bias.time64, seq_start, L, cols)
    lo = tl.min(ta, axis=0).to(tl.float64) - tl.max(tb, axis=0).to(tl.float64)
    hi = tl.max(ta, axis=0).to(tl.float64) - tl.min(tb, axis=0).to(tl.float64)
    gmin = tl.where(lo >= 0, lo, tl.where(hi <= 0, -hi, 0.0))
    gmax = tl.maximum(hi, -lo)
    b_lo = tl.maximum(bucket_of(bias, gmin) - 1, 0)
    b_hi = tl.minimum(bucket_of(bias, gmax) + 1, bias.max_bucket)
    return ta, tb, b_lo, b_hi


@triton.jit
def _wide_far(bias, k, ta, tb, TRANS: tl.constexpr):
    """Pairs with ``|ta - tb| >= E_k``, as ``tb <= ta - E_k`` or ``tb >= ta + E_k``: per-row int64 thresholds
    against per-key int64 times, no 64-bit value per pair. Exact for any int64 times: a threshold beyond the
    int64 range (it would wrap) is one no time reaches. Only edges up to ``max_bucket`` (finite) are asked."""
    e = tl.minimum(tl.load(bias.edges + k), 9223372036854774784.0).to(tl.int64)  # k <= max_bucket: finite
    below = ta - e
    above = ta + e
    # Wrapped (e >= 0, so a wrapped threshold lies on the wrong side of ta): no int64 time is that far.
    below_none = below > ta
    above_none = above < ta
    # One return: Triton types every return of a function, a constexpr branch's too (tiles need not be square).
    if TRANS:
        far = ((tb[:, None] <= below[None, :]) & ~below_none[None, :]) | (
            (tb[:, None] >= above[None, :]) & ~above_none[None, :])
    else:
        far = ((tb[None, :] <= below[:, None]) & ~below_none[:, None]) | (
            (tb[None, :] >= above[:, None]) & ~above_none[:, None])
    return far


@triton.jit
def _tile_times(bias, seq_start, L, rows, cols, ai, bi, TRANS: tl.constexpr):
    """The tile's per-row times: the held side as given (``bi``, the program's keys, when TRANS; else ``ai``, its
    query rows), the other read now (called only by tiles of several buckets)."""
    if TRANS:
        av = _at(bias.next32, seq_start, L, rows)
        bv = bi
    else:
        av = ai
        bv = _at(bias.time32, seq_start, L, cols)
    return av, bv


@triton.jit
def _time_steps(s, w, tsw, bias, ai, bi, d, b_lo, b_hi, TRANS: tl.constexpr, ONE_SIDED: tl.constexpr):
    """``s`` plus, for each edge in ``b_lo + 1 .. b_hi``, the step to the next weight where the pair reaches it."""
    # The first UNROLLED edges unrolled, the rest in a loop behind a branch: a loop directly in the kernels'
    # main loop stops Triton's software pipelining of the K/V loads (seen on sm_90); a branch does not.
    for j in tl.static_range(UNROLLED):
        k = b_lo + 1 + j
        if k <= b_hi:
            w_next = tl.load(tsw + k)
            s += tl.where(_far(bias, k, ai, bi, d, TRANS, ONE_SIDED), w_next - w, 0.0)
            w = w_next
    if b_hi - b_lo > UNROLLED:
        for k in range(b_lo + 1 + UNROLLED, b_hi + 1):
            w_next = tl.load(tsw + k)
            s += tl.where(_far(bias, k, ai, bi, d, TRANS, ONE_SIDED), w_next - w, 0.0)
            w = w_next
    return s


@triton.jit
def _pair_buckets(bias, ai, bi, d, TRANS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Each pair's bucket, for a tile whose gaps ``|ai - bi + d|`` are all below ``INT32_SPAN``
    (``_add_time_steps``): the gap in int32, an estimate from its float32 bits, one edge load to correct it.

    The gap is exact: ``x + d`` taken modulo ``2^32`` (``d`` truncated to int32 after its int64 value) equals the
    true gap, which lies strictly inside the int32 range. The estimate is ``bucket_of``'s from float32 bits, in
    fixed point: the float's bits less 1.0's, over 2^23, read as ``log2`` are at most 0.0861
    low, and 1179 / 512 is ``ln 2 / 0.301`` less 8e-5, so it is the bucket or the one below. It is never above:
    the estimate is non-decreasing in the gap and at ``E[k] - 1`` at most ``k - 1`` for every edge below 2^31
    (``tests/ops/test_bias_triton.py`` tries both sides of every edge). ``E[est + 1]`` (int32, saturated)
    corrects it."""
    x = ai[None, :] - bi[:, None] if TRANS else ai[:, None] - bi[None, :]
    g = tl.abs(x + d.to(tl.int64).to(tl.int32))
    bits = tl.maximum(g, 1).to(tl.float32).to(tl.int32, bitcast=True)
    est = tl.minimum((((bits - (127 << 23)) >> 8) * 1179) >> 24, bias.num_buckets)
    return est + tl.where(g >= _gather(bias.edges32 + est + 1, DOT_PRECISION, tl.int32), 1, 0)


@triton.jit
def _add_time_steps(s, tsw, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """``s`` plus the time weight of every pair of an int32 tile (``add_bias``): the lowest bucket's weight and
    a step per edge for a tile of up to UNROLLED + 1 buckets; each pair's own bucket and weight
    (``_pair_buckets``, two loads a pair) for a tile of more, the tiles near the diagonal, whose gaps run
    from seconds to hours (under a window, most of the tiles), unless a gap may reach ``INT32_SPAN``."""
    direct = b_hi - b_lo > UNROLLED
    if direct:
        direct = tl.load(bias.edges32 + b_hi + 1) < INT32_MAX  # every gap of the tile lies below that edge
    if direct:
        av, bv = _tile_times(bias, seq_start, L, rows, cols, ai, bi, TRANS)
        s += _gather(tsw + _pair_buckets(bias, av, bv, d, TRANS, DOT_PRECISION), DOT_PRECISION)
    else:
        w = tl.load(tsw + b_lo)
        s += w
        if b_hi > b_lo:
            av, bv = _tile_times(bias, seq_start, L, rows, cols, ai, bi, TRANS)
            if sgn != 0:  # one compare per pair and edge: gaps of one sign, as sgn * gap >= 0
                s = _time_steps(s, w, tsw, bias, av * sgn, bv * sgn, d * sgn, b_lo, b_hi, TRANS, True)
            else:
                s = _time_steps(s, w, tsw, bias, av, bv, d, b_lo, b_hi, TRANS, False)
    return s


@triton.jit
def _add_wide_time_steps(s, tsw, bias, seq_start, L, rows, cols, TRANS: tl.constexpr):
    """``s`` plus the time weight of every pair of a tile that meets a wide chunk, from the int64 times."""
    ta, tb, lo, hi = _wide_times(bias, seq_start, L, rows, cols)
    w = tl.load(tsw + lo)
    s += w
    for k in range(lo + 1, hi + 1):
        w_next = tl.load(tsw + k)
        s += tl.where(_wide_far(bias, k, ta, tb, TRANS), w_next - w, 0.0)
        w = w_next
    return s


@triton.jit
def _gather(ptrs, DOT_PRECISION: tl.constexpr, DTYPE: tl.constexpr = tl.float32):
    """``tl.load(ptrs)`` of float32 (or int32: DTYPE), in the layout ``ptrs`` has (the score tile's), without a
    layout conversion.

    Triton's coalescing pass gives every ``tl.load`` of a pointer tile its own blocked layout and, the load being
    too large to recompute in another layout, converts the result to the score tile's MMA layout through shared
    memory (a store, a barrier and a load per element). An inline PTX load is elementwise, so it stays in the
    layout of its addresses. The position table is read-only in every kernel (its gradient has its own buffer),
    hence the non-coherent cache path. The interpreter, which has no inline assembly, loads plainly; so do IEEE
    float32 dots (FMA, not tensor cores): there the load's own layout is what keeps the SiLU's elementwise
    chain out of the next dot's operand layout, which repeats the tile across threads (sm_90, without it: 32
    times the tanh instructions and 7.5 KB of spills in the forward kernel)."""
    if _IN_PLACE and DOT_PRECISION != "ieee":
        word = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs.to(tl.int64, bitcast=True)],
                                         dtype=tl.int32, is_pure=True, pack=1)
        return word.to(DTYPE, bitcast=True)
    else:
        return tl.load(ptrs)


@triton.jit
def add_bias(s, bias, h, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS: tl.constexpr,
             WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``s`` plus the float32 bias of its tile, ``(rows, cols)``, or ``(cols, rows)`` when TRANS; ``ai``, ``bi``:
    the rows' and keys' int32 times, of which only the program's held side is read (``bi`` when TRANS, else
    ``ai``; pass anything for the other), ``d`` the difference of their bases, ``b_lo .. b_hi`` and ``sgn``:
    ``tile_buckets``.

    The position entry and the lowest bucket's weight first; then for each edge between ``b_lo`` and ``b_hi``
    the step to the next bucket's weight where the pair's gap reaches it (the float32 sum of the steps
    differs from the weight by rounding only), or in a tile of many buckets each pair's own weight
    (``_add_time_steps``). ``d`` NaN (a wide chunk): the same from the int64 times, a
    branch compiled only with WIDE, which the programs of a sequence with a wide chunk run (``Bias.seq_wide``):
    in the other programs' loops it would hold registers that the common path then spills. DOT_PRECISION: the
    kernel's, which decides how the position entries are loaded (``_gather``).
    """
    tsw = bias.ts + h * bias.ts_stride_h
    posw = bias.pos + h * bias.pos_stride_h + bias.pos_center
    if TRANS:
        s += _gather(posw + (cols[:, None] - rows[None, :]), DOT_PRECISION)
    else:
        s += _gather(posw + (cols[None, :] - rows[:, None]), DOT_PRECISION)
    if WIDE:
        if d != d:
            s = _add_wide_time_steps(s, tsw, bias, seq_start, L, rows, cols, TRANS)
        else:
            s = _add_time_steps(s, tsw, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS,
                                DOT_PRECISION)
    else:
        s = _add_time_steps(s, tsw, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS,
                            DOT_PRECISION)
    return s


@triton.jit
def _diagonal_sums(x, G: tl.constexpr, TRANS: tl.constexpr, PRECISION: tl.constexpr):
    """Sums of the tile ``x`` along its diagonals ``d = key - row`` (``x`` is ``(keys, rows)`` when TRANS, else
    ``(rows, keys)``), as a float32 ``(UP, NP)`` matrix: entry ``[u, e]`` holds diagonal
    ``d = G (u - U0) + e - (G - 1)`` for ``u < NX + NY - 1`` and ``e < 2G - 1`` (else 0), ``U0 = NY - 1``
    (TRANS) or ``NX - 1``, ``NX, NY`` the sub-blocks along the two axes."""
    X: tl.constexpr = x.shape[0]
    Y: tl.constexpr = x.shape[1]
    NX: tl.constexpr = X // G
    NY: tl.constexpr = Y // G
    NBLK: tl.constexpr = NX * NY
    NP: tl.constexpr = 2 * G if 2 * G >= 16 else 16
    NU: tl.constexpr = NX + NY - 1
    UP: tl.constexpr = 16 if NU <= 16 else (32 if NU <= 32 else (64 if NU <= 64 else 128))
    # Sub-block (e, a) as one row of NBLK x G^2: row e * NY + a, column f * G + b (f, b: offsets in the block).
    xb = tl.reshape(tl.permute(tl.reshape(x, (NX, G, NY, G)), (0, 2, 1, 3)), (NBLK, G * G))
    kk = tl.arange(0, G * G)
    fine = kk // G - kk % G if TRANS else kk % G - kk // G  # key - row inside the block
    ee = tl.arange(0, NP)
    onehot = tl.where(fine[:, None] + (G - 1) == ee[None, :], 1.0, 0.0).to(x.dtype)
    z = tl.dot(xb, onehot, input_precision=PRECISION)  # (NBLK, NP): each sub-block's diagonal sums
    blk = tl.arange(0, NBLK)
    # The block diagonal of sub-block (e, a) (key block - row block), shifted to >= 0.
    u = blk // NY - blk % NY + (NY - 1) if TRANS else blk % NY - blk // NY + (NX - 1)
    uu = tl.arange(0, UP)
    gather = tl.where(uu[:, None] == u[None, :], 1.0, 0.0)
    return tl.dot(gather, z, input_precision="ieee")  # (UP, NP), float32 throughout


@triton.jit
def _reached_sum(g, far):
    return tl.sum(tl.sum(tl.where(far, g, 0.0), axis=1), axis=0)


@triton.jit
def _edge_grads(g, dts, prev, bias, ai, bi, d, b_lo, b_hi, TRANS: tl.constexpr, ONE_SIDED: tl.constexpr):
    """The gradients of buckets ``b_lo .. b_hi - 1`` (``_time_grads``); returns the last bucket's."""
    for j in tl.static_range(UNROLLED):  # as in add_bias
        k = b_lo + 1 + j
        if k <= b_hi:
            part = _reached_sum(g, _far(bias, k, ai, bi, d, TRANS, ONE_SIDED))
            tl.atomic_add(dts + k - 1, prev - part, sem="relaxed")
            prev = part
    if b_hi - b_lo > UNROLLED:
        for k in range(b_lo + 1 + UNROLLED, b_hi + 1):
            part = _reached_sum(g, _far(bias, k, ai, bi, d, TRANS, ONE_SIDED))
            tl.atomic_add(dts + k - 1, prev - part, sem="relaxed")
            prev = part
    return prev


@triton.jit
def _bucket_grads(g, dts, bias, av, bv, d, b_lo, b_hi, TRANS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The time-bucket gradients of a tile of many buckets whose gaps all lie below ``INT32_SPAN`` (as in
    ``_add_time_steps``): each pair's bucket (``_pair_buckets``), then per bucket a sum along the tile's axis 1,
    which stays inside a warp, set into column ``b - r0`` of a ``(X, BUCKETS_AT_ONCE)`` tile; one reduction
    across the warps and one vector atomic per ``BUCKETS_AT_ONCE`` buckets, where the edge sums
    (``_edge_grads``) cost a reduction across the warps, with its barrier, and an atomic per edge."""
    bkt = _pair_buckets(bias, av, bv, d, TRANS, DOT_PRECISION)
    R: tl.constexpr = BUCKETS_AT_ONCE
    rr = tl.arange(0, R)
    for r0 in range(b_lo, b_hi + 1, R):
        acc = tl.zeros((g.shape[0], R), dtype=tl.float32)
        for r in range(0, tl.minimum(b_hi + 1 - r0, R)):
            part = tl.sum(tl.where(bkt == r0 + r, g, 0.0), axis=1)
            acc = tl.where(rr[None, :] == r, part[:, None], acc)
        tl.atomic_add(dts + r0 + rr, tl.sum(acc, axis=0), mask=rr <= b_hi - r0, sem="relaxed")


@triton.jit
def _summed_edge_grads(g, dts, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS: tl.constexpr):
    """The time-bucket gradients of an int32 tile from the tile's total and a sum per edge (``_edge_grads``)."""
    prev = tl.sum(tl.sum(g, axis=1), axis=0)
    if b_hi > b_lo:
        av, bv = _tile_times(bias, seq_start, L, rows, cols, ai, bi, TRANS)
        if sgn != 0:  # as in _add_time_steps
            prev = _edge_grads(g, dts, prev, bias, av * sgn, bv * sgn, d * sgn, b_lo, b_hi, TRANS, True)
        else:
            prev = _edge_grads(g, dts, prev, bias, av, bv, d, b_lo, b_hi, TRANS, False)
    tl.atomic_add(dts + b_hi, prev, sem="relaxed")


@triton.jit
def _time_grads(g, dts, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS: tl.constexpr,
                DOT_PRECISION: tl.constexpr, PAIR_GRADS: tl.constexpr):
    """The time-bucket gradients of an int32 tile (``bias_grad``): with PAIR_GRADS, per bucket directly in a tile
    of many (``_bucket_grads``); else, and in the other tiles, by edge sums (``_summed_edge_grads``).

    PAIR_GRADS is the mask-function kernels' (``backward``: MODE_FUNC, what SLA and OneRank run), where it was
    measured (SLA 256/32, H100: dK/dV 1170 -> 1047 us; with random times the whole call 4.25 -> 2.66 ms). Not
    the causal kernel's: most of its tiles lie far below the diagonal in one bucket, and the per-bucket path's
    registers (spills 320 -> 416 B) made them slower (dK/dV 4.70 -> 4.94 ms on an H100); nor, until measured,
    the fixed rule's, whose walks without a window are the causal ones."""
    direct = PAIR_GRADS and b_hi - b_lo > UNROLLED
    if direct:
        direct = tl.load(bias.edges32 + b_hi + 1) < INT32_MAX  # as in _add_time_steps
    if direct:
        av, bv = _tile_times(bias, seq_start, L, rows, cols, ai, bi, TRANS)
        _bucket_grads(g, dts, bias, av, bv, d, b_lo, b_hi, TRANS, DOT_PRECISION)
    else:
        _summed_edge_grads(g, dts, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS)


@triton.jit
def _wide_time_grads(g, dts, bias, seq_start, L, rows, cols, TRANS: tl.constexpr):
    """The time-bucket gradients of a tile that meets a wide chunk, from the int64 times."""
    ta, tb, lo, hi = _wide_times(bias, seq_start, L, rows, cols)
    prev = tl.sum(tl.sum(g, axis=1), axis=0)
    for k in range(lo + 1, hi + 1):
        part = _reached_sum(g, _wide_far(bias, k, ta, tb, TRANS))
        tl.atomic_add(dts + k - 1, prev - part, sem="relaxed")
        prev = part
    tl.atomic_add(dts + hi, prev, sem="relaxed")


@triton.jit
def bias_grad(bias, h, seq_start, L, ds, rows, cols, ai, bi, d, b_lo, b_hi, sgn, scale, DOT_PRECISION: tl.constexpr,
              TRANS: tl.constexpr, WIDE: tl.constexpr, PAIR_GRADS: tl.constexpr):
    """Add this tile's table gradients into ``bias.dts`` and ``bias.dpos``: ``ds`` is the tile's masked
    gradient of the pre-silu scores divided by ``scale`` (``(cols, rows)`` when TRANS, else ``(rows, cols)``);
    the other arguments as for ``add_bias`` (``rows``, ``cols``: the tile's local positions, from its origin;
    WIDE: the int64 path compiled in; PAIR_GRADS: ``_time_grads``)."""
    g = ds.to(tl.float32) * scale
    dts = bias.dts + h * bias.ts_stride_h
    # Time buckets: per bucket, or the sum over pairs whose gap reaches each edge, bucket b getting the difference
    # of consecutive sums (_time_grads).
    if WIDE:
        if d != d:
            _wide_time_grads(g, dts, bias, seq_start, L, rows, cols, TRANS)
        else:
            _time_grads(g, dts, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS, DOT_PRECISION,
                        PAIR_GRADS)
    else:
        _time_grads(g, dts, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS, DOT_PRECISION,
                    PAIR_GRADS)
    # Positions: diagonal sums of the tile, then one atomic per (block diagonal, offset).
    X: tl.constexpr = ds.shape[0]
    Y: tl.constexpr = ds.shape[1]
    G: tl.constexpr = 16 if (X // 16) * (Y // 16) >= 16 else (8 if (X // 8) * (Y // 8) >= 16 else 4)
    if ds.dtype == tl.float32:
        PRECISION: tl.constexpr = "ieee" if DOT_PRECISION == "ieee" else "tf32x3"
        diag = _diagonal_sums(g, G, TRANS, PRECISION)
    else:
        diag = _diagonal_sums(ds, G, TRANS, "tf32") * scale
    NU: tl.constexpr = X // G + Y // G - 1
    U0: tl.constexpr = Y // G - 1 if TRANS else X // G - 1
    uu = tl.arange(0, diag.shape[0])
    ee = tl.arange(0, diag.shape[1])
    d = G * (uu[:, None] - U0) + ee[None, :] - (G - 1)
    origin = tl.min(cols, axis=0) - tl.min(rows, axis=0)  # key - row at the tile's first row and key
    dpos = bias.dpos + h * bias.pos_stride_h + bias.pos_center + origin
    tl.atomic_add(dpos + d, diag, mask=(uu[:, None] < NU) & (ee[None, :] < 2 * G - 1), sem="relaxed")
