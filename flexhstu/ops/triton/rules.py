"""The mask rules in closed form, per query row: the interval a row sees, for each MODE.

MODE_FUNC reads the func tensor (docs/design.md, section 2); MODE_CAUSAL is
``[0, i + 1)``; MODE_FIXED is the fixed rule (docs/design.md, section 3) as at
most three intervals per row, computed from the sequence length and the rule's
parameters, so no func tensor is built.
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = 1 << 30
"""Larger than any sequence position: the neutral start of a min-reduced hull."""

MODE_FUNC = 0
MODE_CAUSAL = 1
MODE_FIXED = 2


@triton.jit
def fixed_ids(x, off, max_id, HAS_T: tl.constexpr):
    """HSTU ids: contextual rows share id 0, targets share ``max_id``."""
    ids = tl.maximum(x - off, 0)
    if HAS_T:
        ids = tl.minimum(ids, max_id)
    return ids


@triton.jit
def fixed_first_ge(v, L, off, max_id, HAS_T: tl.constexpr):
    """First local position whose id is >= v (ids are non-decreasing), in [0, L]."""
    id_first = fixed_ids(0, off, max_id, HAS_T)
    id_last = fixed_ids(L - 1, off, max_id, HAS_T)
    return tl.where(v <= id_first, 0, tl.where(v > id_last, L, tl.minimum(v + off, L)))


@triton.jit
def fixed_interval(rows, L, j: tl.constexpr, fx_t, fx_c, fx_w, fx_f, HAS_T: tl.constexpr):
    """The fixed rule in closed form (as masks.fixed): row i sees C u A u {i}.

    j = 0: C = [0, first_ge(max_id)) for contextual rows; j = 1: A = [0 or
    window start, first_ge(ids(i))); j = 2: {i}.
    """
    off = tl.maximum(fx_c - 1, 0)
    max_id = L - off - fx_t
    cur = fixed_ids(rows, off, max_id, HAS_T)
    if j == 0:
        start = tl.zeros_like(rows)
        end = tl.where((fx_c > 0) & (cur == 0), fixed_first_ge(max_id + tl.zeros_like(rows), L, off, max_id, HAS_T), 0)
    elif j == 1:
        end = fixed_first_ge(cur, L, off, max_id, HAS_T)
        windowed = (fx_w > 0) & ~((fx_f > 0) & (cur >= max_id - fx_f))
        start = tl.where(windowed, fixed_first_ge(cur - fx_w, L, off, max_id, HAS_T), 0)
    else:
        start = rows
        end = rows + 1
    return start, end


@triton.jit
def row_interval(fbase, stride_fj, stride_ft, rows, rows_g, row_ok, L, j: tl.constexpr, MODE: tl.constexpr,
                 fx_t, fx_c, fx_w, fx_f, HAS_T: tl.constexpr):
    """Interval ``j`` of each row, clipped to ``[0, L)``; rows past ``L`` get ``[0, 0)``.

    MODE: 0 reads the func tensor, 1 is causal ``[0, i + 1)``, 2 is the fixed rule.
    """
    if MODE == 1:
        start = tl.zeros_like(rows)
        end = rows + 1
    elif MODE == 2:
        start, end = fixed_interval(rows, L, j, fx_t, fx_c, fx_w, fx_f, HAS_T)
    else:
        if j == 0:
            start = tl.zeros_like(rows)
        else:
            start = tl.load(fbase + (2 * j - 1) * stride_fj + rows_g * stride_ft, mask=row_ok, other=0)
        end = tl.load(fbase + (2 * j) * stride_fj + rows_g * stride_ft, mask=row_ok, other=0)
    start = tl.maximum(start, 0)
    end = tl.where(row_ok, tl.minimum(end, L), 0)
    return start, end




@triton.jit
def causal_bounds(m0, L, BLOCK_M: tl.constexpr, RP: tl.constexpr):
    """Closed-form hull/core of a causal query block starting at row ``m0``: rows see ``[0, i + 1)``."""
    jr = tl.arange(0, RP)
    first = jr == 0
    hlo = tl.where(first, 0, 1 << 30)
    hhi = tl.where(first, tl.minimum(m0 + BLOCK_M, L), 0)
    clo = tl.where(first, 0, 1 << 30)
    chi = tl.where(first, m0 + 1, 0)
    return hlo, hhi, clo, chi


