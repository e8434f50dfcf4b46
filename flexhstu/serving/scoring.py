"""Request planning for candidate scoring: which candidates go into which micro-batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._errors import as_int
from ..jagged import check_offsets_meta, check_offsets_values


class MicroBatch(NamedTuple):
    """``index (c,)``: rows of the request's candidates in this micro-batch, user by user; ``counts``: per user, as
    host ints and as ``counts_tensor (B,)`` int64 on the offsets' device (a delta call reads it, no copy then)."""

    index: torch.Tensor
    counts: list[int]
    counts_tensor: torch.Tensor


def micro_batches(cand_offsets: torch.Tensor, micro_batch: int | None, total: int | None = None) -> list[MicroBatch]:
    """Split each user's candidates (jagged by ``cand_offsets (B + 1,)``) into consecutive chunks of at most
    ``micro_batch`` (None: all at once). Micro-batch ``j`` holds candidates ``[j m, (j + 1) m)`` of every user
    that has them. Reads the offsets (one sync per request on CUDA) and moves every micro-batch's indices and
    counts to the device in one copy: a copy from pageable host memory waits for the device, so one per
    micro-batch would keep the host from running ahead of the device. ``total``: the number of candidates, which
    the offsets must end at (unchecked when None)."""
    check_offsets_meta(cand_offsets, "cand_offsets")
    offs = cand_offsets.detach().to("cpu", torch.int64)
    check_offsets_values(offs, "cand_offsets", total=total)
    counts = offs.diff().tolist()
    widest = max(counts, default=0)
    size = widest if micro_batch is None else as_int("micro_batch", micro_batch, minimum=1)
    plans = []
    for lo in range(0, widest, max(size, 1)):
        take = [max(0, min(size, n - lo)) for n in counts]
        index = torch.cat([torch.arange(int(o) + lo, int(o) + lo + t) for o, t in zip(offs[:-1].tolist(), take)])
        plans.append((index, take))
    if not plans:
        return []
    flat = torch.cat([torch.cat([index, torch.tensor(take, dtype=torch.int64)]) for index, take in plans])
    pieces = flat.to(cand_offsets.device).split([index.numel() + len(take) for index, take in plans])
    return [
        MicroBatch(piece[: index.numel()], take, piece[index.numel() :]) for piece, (index, take) in zip(pieces, plans)
    ]
