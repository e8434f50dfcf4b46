"""Input encoding: item embeddings plus position (counted back from the end) and time-gap buckets."""

from __future__ import annotations

import torch
from torch import nn

from .._errors import bad_type, bad_value
from ..jagged import can_read_values, row_coords


def check_item_ids(ids: object, table: nn.Module, arg: str = "item_ids") -> None:
    """``ids`` must be an integer tensor, and (where values can be read without a sync: CPU tensors) hold rows
    of ``table`` (an ``nn.Embedding``; 0 is padding): a raw ``index out of range in self`` or a dtype error
    from the embedding otherwise. On CUDA the embedding's own device assert stays the check."""
    if not isinstance(ids, torch.Tensor):
        raise bad_type(arg, "an integer tensor of item ids", type(ids).__name__)
    if ids.dtype not in (torch.int64, torch.int32):
        raise bad_type(arg, "an int64 or int32 tensor of item ids", ids.dtype)
    rows = getattr(table, "num_embeddings", None)
    if rows is not None and ids.numel() and can_read_values(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= rows:
            raise bad_value(arg, f"item ids from 1 to num_items = {rows - 1} (0: padding)", lo if lo < 0 else hi)


def time_gap_buckets(timestamps: torch.Tensor, seq_offsets: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log2 buckets of the gap (seconds) to the previous event of the same sequence; 0 for the first."""
    total = timestamps.numel()
    _, i, _ = row_coords(seq_offsets, total)
    prev = torch.roll(timestamps, 1)
    gap = torch.where(i > 0, (timestamps - prev).clamp(min=0), torch.zeros_like(timestamps))
    return torch.floor(torch.log2(gap.double() + 1.0)).long().clamp(0, num_buckets - 1)


class InputEncoder(nn.Module):
    """``item_emb[ids] + pos_emb[L - 1 - i] + gap_emb[bucket(t_i - t_{i-1})]`` over a jagged batch."""

    def __init__(self, num_items: int, dim: int, max_len: int, num_time_buckets: int = 32):
        super().__init__()
        self.items = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.positions = nn.Embedding(max_len, dim)
        self.gaps = nn.Embedding(num_time_buckets, dim)
        self.max_len = max_len
        self.num_time_buckets = num_time_buckets
        nn.init.normal_(self.items.weight, std=dim**-0.5)
        nn.init.normal_(self.positions.weight, std=0.02)
        nn.init.normal_(self.gaps.weight, std=0.02)

    def forward(self, item_ids: torch.Tensor, timestamps: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
        check_item_ids(item_ids, self.items)
        if timestamps.shape != item_ids.shape:
            raise bad_value(
                "timestamps", f"one time per item, shape {tuple(item_ids.shape)}", f"shape {tuple(timestamps.shape)}"
            )
        _, i, length = row_coords(seq_offsets, item_ids.numel())
        back = (length - 1 - i).clamp(0, self.max_len - 1)
        gaps = time_gap_buckets(timestamps, seq_offsets, self.num_time_buckets)
        return self.items(item_ids) + self.positions(back) + self.gaps(gaps)
