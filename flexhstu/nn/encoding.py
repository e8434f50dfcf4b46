"""Input encoding: item embeddings plus position (counted back from the end) and time-gap buckets."""

from __future__ import annotations

import torch
from torch import nn

from .._errors import bad_value
from ..jagged import row_coords


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
        if timestamps.shape != item_ids.shape:
            raise bad_value("timestamps", f"one time per item, shape {tuple(item_ids.shape)}",
                            f"shape {tuple(timestamps.shape)}")
        _, i, length = row_coords(seq_offsets, item_ids.numel())
        back = (length - 1 - i).clamp(0, self.max_len - 1)
        gaps = time_gap_buckets(timestamps, seq_offsets, self.num_time_buckets)
        return self.items(item_ids) + self.positions(back) + self.gaps(gaps)
