"""The jagged layout: ``(B + 1,)`` offsets, per-row coordinates, offset checks.

Sequence ``b`` owns rows ``seq_offsets[b] : seq_offsets[b + 1]`` of every jagged
tensor; length 0 is legal (docs/design.md, section 1). Masks, ops and layers all
read the layout through this module, so it imports nothing from them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._errors import bad_type, bad_value

OFFSET_DTYPES = (torch.int32, torch.int64)


def offsets_from_lengths(lengths: Sequence[int], *, dtype: torch.dtype = torch.int64, device=None) -> torch.Tensor:
    """``(B + 1,)`` offsets ``[0, L0, L0 + L1, ...]`` of a list of lengths (each ``>= 0``)."""
    lengths = [int(n) for n in lengths]
    bad = [n for n in lengths if n < 0]
    if bad:
        raise bad_value("lengths", "non-negative sequence lengths", bad[0])
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, dtype=dtype, device=device)


def check_offsets_meta(seq_offsets: torch.Tensor, arg: str = "seq_offsets") -> None:
    """Shape, dtype and type checks that never read device memory."""
    if not isinstance(seq_offsets, torch.Tensor):
        raise bad_type(arg, "a torch.Tensor", type(seq_offsets).__name__)
    if seq_offsets.dtype not in OFFSET_DTYPES:
        raise bad_type(arg, "dtype torch.int32 or torch.int64", seq_offsets.dtype)
    if seq_offsets.dim() != 1 or seq_offsets.numel() < 1:
        raise bad_value(arg, "a 1-D tensor of B + 1 >= 1 offsets", f"shape {tuple(seq_offsets.shape)}")


def check_offsets_values(seq_offsets: torch.Tensor, arg: str = "seq_offsets", total: int | None = None) -> None:
    """Value checks (reads the tensor: a host-device sync on CUDA)."""
    offs = seq_offsets.detach().to("cpu", torch.int64)
    if int(offs[0]) != 0:
        raise bad_value(f"{arg}[0]", "0", int(offs[0]))
    steps = offs[1:] - offs[:-1]
    if bool((steps < 0).any()):
        b = int(torch.nonzero(steps < 0)[0, 0])
        got = f"{arg}[{b + 1}] = {int(offs[b + 1])} < {arg}[{b}] = {int(offs[b])}"
        raise bad_value(arg, "non-decreasing offsets", got)
    if total is not None and int(offs[-1]) != total:
        raise bad_value(f"{arg}[-1]", f"the number of rows of the data ({total})", int(offs[-1]))


def row_coords(seq_offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each jagged row ``t``: (sequence id, local position, sequence length), int64 ``(total,)`` each.

    Sync-free: ``total`` comes from the caller.
    """
    offs = seq_offsets.to(torch.int64)
    t = torch.arange(total, device=offs.device, dtype=torch.int64)
    seq = torch.searchsorted(offs, t, right=True) - 1
    seq = seq.clamp(0, max(offs.numel() - 2, 0))
    start = offs[seq]
    length = offs[seq + 1] - start
    return seq, t - start, length
