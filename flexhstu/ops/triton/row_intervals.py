"""The mask rules in closed form, per query row: the interval a row sees, for each MODE.

MODE_FUNC reads the func tensor (docs/design.md, section 2); MODE_CAUSAL is
``[0, i + 1)``; MODE_FIXED is the fixed rule (docs/design.md, section 3) as at
most three intervals per row, computed from the sequence length and the rule's
parameters, so no func tensor is built.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .args import Func

BIG = tl.constexpr(1 << 30)
"""Larger than any sequence position: the start of an empty hull, the end of a core that covers all."""

MODE_FUNC = tl.constexpr(0)
MODE_CAUSAL = tl.constexpr(1)
MODE_FIXED = tl.constexpr(2)


@triton.jit
def head_func(func, h):
    """The func rows of head ``h`` (the same rows for every head when ``func.stride_h`` is 0)."""
    return Func(func.ptr + h * func.stride_h, func.stride_h, func.stride_j, func.stride_t)


@triton.jit
def sequence_targets(rule, seq, HAS_TARGETS: tl.constexpr):
    """num_targets of sequence ``seq`` (0 without targets)."""
    targets = 0
    if HAS_TARGETS:
        targets = tl.load(rule.num_targets + seq).to(tl.int32)
    return targets


@triton.jit
def fixed_ids(x, off, max_id, HAS_TARGETS: tl.constexpr):
    """HSTU ids: contextual rows share id 0, targets share ``max_id``."""
    ids = tl.maximum(x - off, 0)
    if HAS_TARGETS:
        ids = tl.minimum(ids, max_id)
    return ids


@triton.jit
def fixed_first_ge(v, L, off, max_id, HAS_TARGETS: tl.constexpr):
    """First local position whose id is >= v (ids are non-decreasing), in [0, L]."""
    id_first = fixed_ids(0, off, max_id, HAS_TARGETS)
    id_last = fixed_ids(L - 1, off, max_id, HAS_TARGETS)
    return tl.where(v <= id_first, 0, tl.where(v > id_last, L, tl.minimum(v + off, L)))


@triton.jit
def _fixed_window(cur, L, off, max_id, rule, HAS_TARGETS: tl.constexpr):
    """Interval A of the fixed rule for rows of id ``cur``: ``[0 or window start, first_ge(cur))``."""
    end = fixed_first_ge(cur, L, off, max_id, HAS_TARGETS)
    windowed = (rule.window > 0) & ~((rule.min_full > 0) & (cur >= max_id - rule.min_full))
    start = tl.where(windowed, fixed_first_ge(cur - rule.window, L, off, max_id, HAS_TARGETS), 0)
    return start, end


@triton.jit
def fixed_interval(rows, L, j: tl.constexpr, targets, rule, HAS_TARGETS: tl.constexpr):
    """The fixed rule in closed form (as masks.fixed): row i sees C u A u {i}.

    j = 0: C = [0, first_ge(max_id)) for contextual rows; j = 1: A = [0 or
    window start, first_ge(ids(i))); j = 2: {i} when A does not hold i, else empty.
    """
    off = tl.maximum(rule.contextual - 1, 0)
    max_id = L - off - targets
    cur = fixed_ids(rows, off, max_id, HAS_TARGETS)
    if j == 0:
        start = tl.zeros_like(rows)
        contextual_row = (rule.contextual > 0) & (cur == 0)
        end = tl.where(contextual_row, fixed_first_ge(max_id + tl.zeros_like(rows), L, off, max_id, HAS_TARGETS), 0)
    elif j == 1:
        start, end = _fixed_window(cur, L, off, max_id, rule, HAS_TARGETS)
    else:
        # {i}, unless the row's interval 1 already holds i (every row but a target row past its window):
        # then empty, so its hull stays empty and masking never evaluates it.
        s1, e1 = _fixed_window(cur, L, off, max_id, rule, HAS_TARGETS)
        covered = (s1 <= rows) & (rows < e1)
        start = tl.where(covered, 0, rows)
        end = tl.where(covered, 0, rows + 1)
    return start, end


@triton.jit
def row_interval(func, targets, rule, rows, rows_g, row_ok, L, j: tl.constexpr,
                 MODE: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """Interval ``j`` of each row, clipped to ``[0, L)``; rows past ``L`` get ``[0, 0)``.

    ``func``: one head's rows (``head_func``); ``rows``: local positions, ``rows_g``: jagged rows.
    """
    if MODE == MODE_CAUSAL:
        start = tl.zeros_like(rows)
        end = rows + 1
    elif MODE == MODE_FIXED:
        start, end = fixed_interval(rows, L, j, targets, rule, HAS_TARGETS)
    else:
        if j == 0:
            start = tl.zeros_like(rows)
        else:
            start = tl.load(func.ptr + (2 * j - 1) * func.stride_j + rows_g * func.stride_t, mask=row_ok, other=0)
        end = tl.load(func.ptr + (2 * j) * func.stride_j + rows_g * func.stride_t, mask=row_ok, other=0)
    start = tl.maximum(start, 0)
    end = tl.where(row_ok, tl.minimum(end, L), 0)
    return start, end


@triton.jit
def causal_bounds(m0, L, BLOCK_M: tl.constexpr, INTERVALS_POW2: tl.constexpr):
    """Closed-form hull/core of a causal query block starting at row ``m0``: rows see ``[0, i + 1)``."""
    jr = tl.arange(0, INTERVALS_POW2)
    first = jr == 0
    hlo = tl.where(first, 0, BIG)
    hhi = tl.where(first, tl.minimum(m0 + BLOCK_M, L), 0)
    clo = tl.where(first, 0, BIG)
    chi = tl.where(first, m0 + 1, 0)
    return hlo, hhi, clo, chi
