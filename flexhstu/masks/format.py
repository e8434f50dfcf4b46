"""The func tensor: interval encoding of per-row visibility (docs/design.md, section 2).

``func`` is int32 ``(Hf, NFUNC, total)``; column ``t`` describes query row ``t``.
Rows interleave ends and starts::

    interval 0 : [0,            F[0, t])
    interval j : [F[2j - 1, t], F[2j, t])      j = 1 .. (NFUNC - 1) / 2

Key columns are sequence-local; a query of a sequence of length ``L`` sees key
``c`` iff ``0 <= c < L`` and ``c`` lies in at least one interval. An interval
with end <= start is empty.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from .._errors import as_int, bad_type, bad_value
from ..jagged import can_read_values, check_lengths_at_most, check_offsets_meta, check_offsets_values, row_coords

HSTU_ARBITRARY_NFUNC = 5
"""The interchange width of the fbgemm HSTU wheels (three intervals)."""


def num_intervals(nfunc: int) -> int:
    """Number of key intervals a func of width ``nfunc`` encodes: ``(nfunc + 1) // 2``."""
    return (check_nfunc(nfunc, "nfunc") + 1) // 2


def check_nfunc(nfunc: int, arg: str = "nfunc") -> int:
    """``nfunc`` (a Python or NumPy int, not a bool) as an int, after checking it is odd and >= 1."""
    if isinstance(nfunc, (bool, np.bool_, torch.Tensor)):
        raise bad_type(arg, "an odd int >= 1", type(nfunc).__name__)
    try:
        nfunc = operator.index(nfunc)
    except TypeError:
        raise bad_type(arg, "an odd int >= 1", type(nfunc).__name__) from None
    if nfunc < 1 or nfunc % 2 == 0:
        raise bad_value(arg, "an odd int >= 1", nfunc)
    return nfunc


def check_func_meta(func: torch.Tensor, total: int | None = None, nheads: int | None = None, arg: str = "func") -> None:
    """dtype / rank / width / rows / heads checks that never read device memory."""
    if not isinstance(func, torch.Tensor):
        raise bad_type(arg, "a torch.Tensor", type(func).__name__)
    if func.dtype != torch.int32:
        raise bad_type(arg, "dtype torch.int32", func.dtype)
    if func.dim() != 3:
        raise bad_value(arg, "a 3-D tensor (Hf, NFUNC, total)", f"shape {tuple(func.shape)}")
    nf = func.shape[1]
    if nf < 1 or nf % 2 == 0:
        raise bad_value(f"{arg}.shape[1] (NFUNC)", "an odd width >= 1", nf)
    if total is not None and func.shape[2] != total:
        raise bad_value(f"{arg}.shape[2]", f"one column per query row ({total})", func.shape[2])
    if nheads is not None and func.shape[0] not in (1, nheads):
        raise bad_value(f"{arg}.shape[0] (Hf)", f"1 or the number of heads ({nheads})", func.shape[0])


def validate(func: torch.Tensor, seq_offsets: torch.Tensor, *, nheads: int | None = None) -> torch.Tensor:
    """Check that ``func`` is a well-formed mask for ``seq_offsets``; return it unchanged.

    Raises TypeError (wrong dtype or type) or ValueError (shape, width, heads,
    offsets) naming the argument, what was expected and what was given. Reads
    ``seq_offsets`` (a sync on CUDA): call it when building, not per step.
    """
    check_offsets_meta(seq_offsets)
    check_func_meta(func, nheads=nheads)
    if func.device != seq_offsets.device:
        raise bad_value("func.device", f"the device of seq_offsets ({seq_offsets.device})", func.device)
    check_offsets_values(seq_offsets, total=func.shape[2])
    return func


def widen(func: torch.Tensor, nfunc: int) -> torch.Tensor:
    """Pad ``func`` to width ``nfunc`` with empty intervals ``[0, 0)``.

    A stride-0 head expansion stays a stride-0 expansion (no copy per head).
    """
    check_func_meta(func)
    nfunc = check_nfunc(nfunc)
    cur = func.shape[1]
    if nfunc < cur:
        raise bad_value("nfunc", f"at least the current width {cur}", nfunc)
    if nfunc == cur:
        return func
    hf = func.shape[0]
    base = func[:1] if (hf > 1 and func.stride(0) == 0) else func
    pad = base.new_zeros(base.shape[0], nfunc - cur, base.shape[2])
    out = torch.cat([base, pad], dim=1)
    return out.expand(hf, nfunc, func.shape[2]) if base is not func else out


def pack_intervals(
    prefix_end: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]], nfunc: int
) -> torch.Tensor:
    """Pack per-row interval unions into a ``(NFUNC, rows)`` func.

    ``prefix_end``: end of the interval starting at 0 (0 when none); ``pieces``:
    further ``(lo, hi)`` intervals ordered by ``lo`` (empty ones allowed).
    Touching or overlapping intervals are merged; unused slots stay ``[0, 0)``.
    The caller guarantees the union fits ``nfunc`` (builders derive it from
    their rule).
    """
    nint = (nfunc + 1) // 2
    out = torch.zeros(nfunc, prefix_end.numel(), dtype=torch.int64, device=prefix_end.device)
    slot = torch.zeros_like(prefix_end)
    cur_lo = torch.zeros_like(prefix_end)
    cur_hi = prefix_end.clone()

    def emit(where: torch.Tensor) -> None:
        for s in range(nint):
            sel = where & (slot == s)
            if s == 0:
                out[0] = torch.where(sel, cur_hi, out[0])
            else:
                out[2 * s - 1] = torch.where(sel, cur_lo, out[2 * s - 1])
                out[2 * s] = torch.where(sel, cur_hi, out[2 * s])

    for lo, hi in pieces:
        nonempty = hi > lo
        new = nonempty & (lo > cur_hi)
        emit(new)
        slot = slot + new.to(slot.dtype)
        cur_lo = torch.where(new, lo, cur_lo)
        cur_hi = torch.where(new, hi, torch.where(nonempty, torch.maximum(cur_hi, hi), cur_hi))
    emit(torch.ones_like(prefix_end, dtype=torch.bool))
    return out.to(torch.int32)


def to_dense(func: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Decode ``func`` to a bool mask ``(B, Hf, N, N)``, ``N = max_seq_len``.

    ``[b, h, i, c]`` is True iff query ``i`` of sequence ``b`` sees key ``c``;
    padding rows and columns (``>= L_b``) are False. For CPU offsets, a sequence
    longer than ``max_seq_len`` (or offsets that do not match ``func``) raise
    ValueError; CUDA offsets are not read (no sync), and there a longer
    sequence is cut to its first ``N`` rows and columns.
    """
    check_offsets_meta(seq_offsets)
    check_func_meta(func)
    n = as_int("max_seq_len", max_seq_len)
    if can_read_values(seq_offsets):
        check_offsets_values(seq_offsets, total=func.shape[2])
        check_lengths_at_most(seq_offsets, n)
    offs = seq_offsets.to(torch.int64)
    bsz = offs.numel() - 1
    total = func.shape[2]
    lengths = offs[1:] - offs[:-1]
    pos = torch.arange(n, device=func.device)
    valid = pos[None, :] < lengths[:, None]  # (B, N)
    rows = (offs[:-1, None] + pos[None, :]).clamp(0, max(total - 1, 0))
    if total == 0:
        return torch.zeros(bsz, func.shape[0], n, n, dtype=torch.bool, device=func.device)
    f = func[:, :, rows].permute(2, 0, 3, 1).to(torch.int64)  # (B, Hf, N, NFUNC)
    cols = pos.view(1, 1, 1, n)
    vis = cols < f[..., 0:1]
    for j in range(1, (func.shape[1] + 1) // 2):
        vis = vis | ((cols >= f[..., 2 * j - 1 : 2 * j]) & (cols < f[..., 2 * j : 2 * j + 1]))
    return vis & valid[:, None, :, None] & valid[:, None, None, :]


def from_dense(dense: torch.Tensor, seq_offsets: torch.Tensor, *, nfunc: int | None = None) -> torch.Tensor:
    """Compress a bool mask ``(B, [Hf,] N, N)`` to a func ``(Hf, NFUNC, total)``, row by row.

    Entries outside a sequence (row or column ``>= L_b``) are ignored. With
    ``nfunc=None`` the width is the smallest that fits every row; a row that
    needs more intervals than ``nfunc`` allows raises ValueError naming the
    sequence, the row and the width it needs.
    """
    check_offsets_meta(seq_offsets)
    if not isinstance(dense, torch.Tensor) or dense.dtype != torch.bool:
        raise bad_type("dense", "a bool tensor", getattr(dense, "dtype", type(dense).__name__))
    if dense.dim() == 3:
        dense = dense[:, None]
    if dense.dim() != 4 or dense.shape[-1] != dense.shape[-2]:
        raise bad_value("dense", "shape (B, [Hf,] N, N)", f"shape {tuple(dense.shape)}")
    if nfunc is not None:
        nfunc = check_nfunc(nfunc)
    check_offsets_values(seq_offsets)  # this function reads values anyway (a sync on CUDA)
    offs = seq_offsets.to(device=dense.device, dtype=torch.int64)
    bsz, hf, n = dense.shape[0], dense.shape[1], dense.shape[-1]
    if offs.numel() - 1 != bsz:
        raise bad_value("dense.shape[0]", f"one mask per sequence ({offs.numel() - 1})", bsz)
    lengths = offs[1:] - offs[:-1]
    if bool((lengths > n).any()):
        raise bad_value("dense", f"N >= every sequence length ({int(lengths.max())})", f"N = {n}")
    if n == 0:  # every sequence is empty
        return torch.zeros(hf, nfunc or 1, 0, dtype=torch.int32, device=dense.device)
    pos = torch.arange(n, device=dense.device)
    valid = pos[None, :] < lengths[:, None]
    d = dense & valid[:, None, :, None] & valid[:, None, None, :]
    prev = torch.nn.functional.pad(d[..., :-1], (1, 0))
    nxt = torch.nn.functional.pad(d[..., 1:], (0, 1))
    starts = d & ~prev
    ends = d & ~nxt
    runs = starts.sum(-1)  # (B, Hf, N)
    first_at_zero = d[..., 0]
    slots = torch.where(runs == 0, torch.ones_like(runs), runs + (~first_at_zero).to(runs.dtype))
    need = 2 * slots - 1
    need = torch.where(valid[:, None, :], need, torch.ones_like(need))
    widest = int(need.max()) if need.numel() else 1
    if nfunc is None:
        nfunc = widest
    elif widest > nfunc:
        b, h, i = (int(x) for x in torch.nonzero(need > nfunc)[0])
        raise ValueError(
            f"dense: sequence {b}, head {h}, row {i} needs {int(need[b, h, i])} func rows "
            f"({(int(need[b, h, i]) + 1) // 2} intervals); nfunc={nfunc} allows {(nfunc + 1) // 2}"
        )
    total = int(offs[-1])
    out = torch.zeros(hf, nfunc, total, dtype=torch.int32, device=dense.device)
    sb, sh, si, sc = torch.nonzero(starts, as_tuple=True)
    ec = torch.nonzero(ends, as_tuple=True)[3] + 1
    run_idx = (torch.cumsum(starts.to(torch.int64), -1) - 1)[sb, sh, si, sc]
    slot = run_idx + (~first_at_zero[sb, sh, si]).to(torch.int64)
    t = offs[sb] + si
    head = sh
    is_prefix = slot == 0
    out[head[is_prefix], 0, t[is_prefix]] = ec[is_prefix].to(torch.int32)
    rest = ~is_prefix
    out[head[rest], 2 * slot[rest] - 1, t[rest]] = sc[rest].to(torch.int32)
    out[head[rest], 2 * slot[rest], t[rest]] = ec[rest].to(torch.int32)
    return out


def count_visible(func: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
    """Exact number of visible (query, key) pairs per func head: int64 ``(Hf,)``.

    Works row by row on the intervals (sorted, swept), so it needs no dense mask
    and runs at any length.
    """
    check_offsets_meta(seq_offsets)
    check_func_meta(func)
    total = func.shape[2]
    if can_read_values(seq_offsets):
        check_offsets_values(seq_offsets, total=total)
    if total == 0:
        return torch.zeros(func.shape[0], dtype=torch.int64, device=func.device)
    _, _, length = row_coords(seq_offsets.to(func.device), total)
    f = func.to(torch.int64)
    nint = (func.shape[1] + 1) // 2
    starts = torch.stack([torch.zeros_like(f[:, 0])] + [f[:, 2 * j - 1] for j in range(1, nint)], -1)
    ends = torch.stack([f[:, 2 * j] for j in range(nint)], -1)
    starts = starts.clamp(min=0)
    ends = torch.minimum(ends, length[None, :, None])
    ends = torch.maximum(ends, starts)  # empty -> zero length
    order = torch.argsort(starts, dim=-1)
    starts = torch.gather(starts, -1, order)
    ends = torch.gather(ends, -1, order)
    covered = torch.zeros_like(starts[..., 0])
    reach = torch.zeros_like(starts[..., 0])
    for j in range(nint):
        lo = torch.maximum(starts[..., j], reach)
        covered = covered + (ends[..., j] - lo).clamp(min=0)
        reach = torch.maximum(reach, ends[..., j])
    return covered.sum(-1)
