"""Request planning for candidate scoring: which candidates go into which micro-batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._errors import as_int
from ..jagged import check_offsets_meta, check_offsets_values


class MicroBatch(NamedTuple):
    """``index (c,)``: rows of the request's candidates in this micro-batch, user by user; ``counts``: per user."""

    index: torch.Tensor
    counts: list[int]


def micro_batches(cand_offsets: torch.Tensor, micro_batch: int | None) -> list[MicroBatch]:
    """Split each user's candidates (jagged by ``cand_offsets (B + 1,)``) into consecutive chunks of at most
    ``micro_batch`` (None: all at once). Micro-batch ``j`` holds candidates ``[j m, (j + 1) m)`` of every user
    that has them. Reads the offsets (one sync per request on CUDA); indices are int64 on the offsets' device."""
    check_offsets_meta(cand_offsets, "cand_offsets")
    offs = cand_offsets.detach().to("cpu", torch.int64)
    check_offsets_values(offs, "cand_offsets")
    counts = offs.diff().tolist()
    widest = max(counts, default=0)
    size = widest if micro_batch is None else as_int("micro_batch", micro_batch, minimum=1)
    out = []
    for lo in range(0, widest, max(size, 1)):
        take = [max(0, min(size, n - lo)) for n in counts]
        index = torch.cat([torch.arange(int(o) + lo, int(o) + lo + t) for o, t in zip(offs[:-1].tolist(), take)])
        out.append(MicroBatch(index.to(cand_offsets.device), take))
    return out
