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


def can_read_values(x: torch.Tensor) -> bool:
    """Whether value checks may read ``x``: CPU tensors outside torch.compile (no sync, no graph break)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def lengths_of(seq_offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``(B,)`` sequence lengths (sync-free)."""
    offs = seq_offsets.to(torch.int64)
    return offs[1:] - offs[:-1]


def check_lengths_at_most(seq_offsets: torch.Tensor, n: int, arg: str = "max_seq_len") -> None:
    """Raise unless every sequence length is ``<= n`` (reads the tensor)."""
    lengths = lengths_of(seq_offsets).cpu()
    if lengths.numel() and int(lengths.max()) > n:
        b = int(torch.argmax(lengths))
        raise bad_value(arg, f"at least every sequence length (sequence {b} has {int(lengths[b])})", n)


def check_num_targets_meta(num_targets: object, batch: int, arg: str = "num_targets") -> None:
    """``num_targets`` is an integer ``(B,)`` tensor (never reads device memory)."""
    if not isinstance(num_targets, torch.Tensor):
        raise bad_type(arg, f"a ({batch},) integer tensor", type(num_targets).__name__)
    if num_targets.dtype.is_floating_point or num_targets.dtype.is_complex or num_targets.dtype == torch.bool:
        raise bad_type(arg, "an integer tensor (target counts)", num_targets.dtype)
    if num_targets.dim() != 1 or num_targets.numel() != batch:
        raise bad_value(arg, f"a ({batch},) tensor", f"shape {tuple(num_targets.shape)}")


def check_num_targets_values(num_targets: torch.Tensor, seq_offsets: torch.Tensor, arg: str = "num_targets") -> None:
    """``0 <= num_targets[b] <= L_b`` for every sequence (reads both tensors)."""
    nt = num_targets.detach().to("cpu", torch.int64)
    lengths = lengths_of(seq_offsets).cpu()
    bad = (nt < 0) | (nt > lengths)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        raise bad_value(f"{arg}[{b}]", f"0 <= T <= the sequence length {int(lengths[b])}", int(nt[b]))


def row_coords(seq_offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each jagged row ``t``: (sequence id, local position, sequence length), int64 ``(total,)`` each.

    Sync-free: ``total`` comes from the caller.
    """
    offs = seq_offsets.to(torch.int64).contiguous()  # searchsorted copies strided boundaries anyway
    t = torch.arange(total, device=offs.device, dtype=torch.int64)
    seq = torch.searchsorted(offs, t, right=True) - 1
    seq = seq.clamp(0, max(offs.numel() - 2, 0))
    start = offs[seq]
    length = offs[seq + 1] - start
    return seq, t - start, length
