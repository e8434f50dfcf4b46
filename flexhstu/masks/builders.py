"""Builders: pure functions of offsets and a few integers -> func ``(1, NFUNC, total)``.

Each returns its rule's minimal width (fixed by the parameters, never by the
data); ``nfunc=`` widens with empty intervals, ``nheads=H`` returns a stride-0
``expand`` view. Rules: docs/design.md, section 3.

Offsets and ``num_targets`` are checked on every path that can afford it: with
``total=None`` the builder reads the offsets anyway (a sync on CUDA), so it checks
them fully; with ``total`` given, CPU tensors are checked (cheap) and CUDA tensors
are not (no sync: call ``masks.validate`` once when building on the GPU).
"""

from __future__ import annotations

import torch

from .._errors import as_int, as_span, bad_value
from ..jagged import (
    can_read_values,
    check_num_targets_meta,
    check_num_targets_values,
    check_offsets_meta,
    check_offsets_values,
    row_coords,
)
from .format import check_nfunc, pack_intervals, widen


def _prepare(seq_offsets: torch.Tensor, total: int | None) -> tuple[int, bool]:
    """``(total, checked)``: the row count, and whether the offsets' values were read and checked."""
    check_offsets_meta(seq_offsets)
    if total is None:
        check_offsets_values(seq_offsets)
        return int(seq_offsets[-1]), True
    total = as_int("total", total)
    checked = can_read_values(seq_offsets)
    if checked:
        check_offsets_values(seq_offsets, total=total)
    return total, checked


def _targets_per_row(
    num_targets: torch.Tensor | None, seq_offsets: torch.Tensor, seq: torch.Tensor, check: bool
) -> torch.Tensor:
    """Per-row T (0 without targets), after checking ``0 <= T <= L`` when ``check``."""
    if num_targets is None:
        return torch.zeros_like(seq)
    check_num_targets_meta(num_targets, seq_offsets.numel() - 1)
    if check:
        check_num_targets_values(num_targets, seq_offsets)
    nt = num_targets.to(device=seq.device, dtype=torch.int64)
    return nt[seq] if seq.numel() else torch.zeros_like(seq)


def _finish(func2d: torch.Tensor, nfunc_min: int, nfunc: int | None, nheads: int) -> torch.Tensor:
    nheads = as_int("nheads", nheads, minimum=1)
    out = func2d[None]
    if nfunc is not None:
        nfunc = check_nfunc(nfunc)
        if nfunc < nfunc_min:
            raise bad_value("nfunc", f"at least this rule's width {nfunc_min}", nfunc)
        out = widen(out, nfunc)
    return out.expand(nheads, out.shape[1], out.shape[2]) if nheads > 1 else out


def causal(
    seq_offsets: torch.Tensor, *, total: int | None = None, nfunc: int | None = None, nheads: int = 1
) -> torch.Tensor:
    """Causal mask: row ``i`` sees ``[0, i + 1)``. Width 1."""
    total, _ = _prepare(seq_offsets, total)
    _, i, _ = row_coords(seq_offsets, total)
    return _finish((i + 1).to(torch.int32)[None], 1, nfunc, nheads)


def fixed(
    seq_offsets: torch.Tensor,
    *,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    total: int | None = None,
    nfunc: int | None = None,
    nheads: int = 1,
) -> torch.Tensor:
    """The HSTU valid-mask rule (causal, targets, contextual prefix, window) as intervals.

    Width: 1 for plain causal; 5 with both targets and ``max_attn_len > 0`` (a
    target row whose window slid past column 0 sees ``[lo, Hb) u {i}``); 3 otherwise.

    Closed form: ``ids`` is non-decreasing, so ``{j : ids(j) < v}`` is a prefix
    ``[0, first_ge(v))``; the row is ``{i} u A u C`` with ``A = [0 or s, p)``
    (history before it, cut to the window) and ``C`` the contextual prefix.
    """
    w = as_span("max_attn_len", max_attn_len)
    c = as_span("contextual_seq_len", contextual_seq_len)
    fmin = as_span("min_full_attn_seq_len", min_full_attn_seq_len)
    total, checked = _prepare(seq_offsets, total)
    seq, i, length = row_coords(seq_offsets, total)
    has_t = num_targets is not None
    t = _targets_per_row(num_targets, seq_offsets, seq, checked)
    off = c - 1 if c > 0 else 0
    max_id = length - off - t

    def ids(x: torch.Tensor) -> torch.Tensor:
        u = (x - off).clamp(min=0)
        return torch.minimum(u, max_id) if has_t else u

    id_first = ids(torch.zeros_like(i))
    id_last = ids(length - 1)

    def first_ge(v: torch.Tensor) -> torch.Tensor:
        mid = (v + off).clamp(0, None)
        above = torch.where(v > id_last, length, torch.minimum(mid, length))
        return torch.where(v <= id_first, torch.zeros_like(v), above)

    cur = ids(i)
    p = first_ge(cur)
    if w > 0:
        full = (cur >= max_id - fmin) if fmin > 0 else torch.zeros_like(cur, dtype=torch.bool)
        a_lo = torch.where(full, torch.zeros_like(p), first_ge(cur - w))
    else:
        a_lo = torch.zeros_like(p)
    ctx_end = torch.where(cur == 0, first_ge(max_id), torch.zeros_like(p)) if c > 0 else torch.zeros_like(p)
    width = 1 if (not has_t and c == 0 and w == 0) else (5 if (has_t and w > 0) else 3)
    func = pack_intervals(ctx_end, [(a_lo, p), (i, i + 1)], width)
    return _finish(func, width, nfunc, nheads)


def sla(
    seq_offsets: torch.Tensor,
    sla_k1: int,
    sla_k2: int,
    *,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    total: int | None = None,
    nfunc: int | None = None,
    nheads: int = 1,
) -> torch.Tensor:
    """Semi-local attention (ULTRA-HSTU): local causal window K1 plus global prefix K2.

    With ``K2e = max(K2, contextual_seq_len)`` and ``Hb = L - T``:

    ===================  ==============================================
    history ``i < Hb``   ``[0, min(K2e, i+1)) u [max(K2e, i-K1+1), i+1)``
    target ``i >= Hb``   ``[0, Hb)`` (all history, not itself)
    ===================  ==============================================

    Width 3. ``sla_k1 >= 1``: the local window holds the row itself (0 would hide every history row past the
    prefix from itself, as ``flexhstu train --sla-k1`` refuses).
    """
    k1 = as_span("sla_k1", sla_k1, 1)
    k2 = as_span("sla_k2", sla_k2)
    c = as_span("contextual_seq_len", contextual_seq_len)
    total, checked = _prepare(seq_offsets, total)
    seq, i, length = row_coords(seq_offsets, total)
    hb = length - _targets_per_row(num_targets, seq_offsets, seq, checked)
    k2e = max(k2, c)
    hist = i < hb
    zero = torch.zeros_like(i)
    f0 = torch.where(hist, (i + 1).clamp(max=k2e), hb)
    f1 = torch.where(hist, (i - k1 + 1).clamp(min=k2e), zero)
    f2 = torch.where(hist, i + 1, zero)
    return _finish(torch.stack([f0, f1, f2]).to(torch.int32), 3, nfunc, nheads)


def onerank(
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor,
    group_size: int,
    *,
    total: int | None = None,
    nfunc: int | None = None,
    nheads: int = 1,
) -> torch.Tensor:
    """OneRank: a prefix, then groups ``[e_C, t_1 .. t_K]`` of ``group_size = K + 1``.

    ================================  ===============================
    prefix ``i < Hb``                 ``[0, i + 1)``
    candidate ``i = g`` (slot 0)      ``[0, Hb) u {g}``
    task ``i = g + k``, ``k >= 1``    ``[0, Hb) u {g} u {i}``
    ================================  ===============================

    Groups never see each other; task tokens never see each other. Width 5
    (3 when ``group_size == 1``). ``num_targets`` must be a multiple of
    ``group_size`` in every sequence.
    """
    group_size = as_int("group_size", group_size, minimum=1)
    if num_targets is None:
        raise bad_value("num_targets", "a (B,) tensor of target counts", None)
    total, checked = _prepare(seq_offsets, total)
    seq, i, length = row_coords(seq_offsets, total)
    t = _targets_per_row(num_targets, seq_offsets, seq, checked)
    if checked:
        nt = num_targets.to(torch.int64)
        bad = nt % group_size != 0
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0, 0])
            raise bad_value(f"num_targets[{b}]", f"a multiple of group_size={group_size}", int(nt[b]))
    func2d, width = onerank_rows(i, length, t, group_size)
    return _finish(func2d, width, nfunc, nheads)


def onerank_rows(
    i: torch.Tensor, length: torch.Tensor, num_targets: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, int]:
    """OneRank's func for chosen rows alone: ``(func2d (width, n) int32, width)`` from each row's local position
    ``i (n,)``, its sequence's length ``(n,)`` and target count ``(n,)`` (int64, on one device). ``onerank`` is
    this over every row; cached serving calls it for the new rows only, so no column is built for the history
    (nor does anything depend on how many history rows there are). Unchecked: the caller's rows are valid."""
    hb = length - num_targets
    hist = i < hb
    g = hb + torch.div((i - hb).clamp(min=0), group_size, rounding_mode="floor") * group_size
    zero = torch.zeros_like(i)
    task = (~hist) & (i != g)
    rows = [
        torch.where(hist, i + 1, hb),
        torch.where(hist, zero, g),
        torch.where(hist, zero, g + 1),
    ]
    if group_size > 1:
        rows += [torch.where(task, i, zero), torch.where(task, i + 1, zero)]
    return torch.stack(rows).to(torch.int32), len(rows)
