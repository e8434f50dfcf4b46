"""The learned tables of the published HSTU's relative attention bias, one module per STU layer."""

from __future__ import annotations

import torch
from torch import nn

from .._errors import as_int
from ..ops.bias import RelativeBias


class RelativeTimePositionBias(nn.Module):
    """``pos_w (2 max_seq_len - 1,)`` per relative position and ``ts_w (num_buckets + 1,)`` per time-gap bucket.

    Shared by the heads and initialised ``N(0, 0.02)``, as the published model. ``forward(timestamps)``
    with ``timestamps (total,)`` integer returns the :class:`flexhstu.ops.bias.RelativeBias` that
    ``hstu_mha(rel_bias=...)`` takes; the rule is in ``flexhstu.ops.bias``.
    """

    def __init__(self, max_seq_len: int, num_buckets: int = 128):
        super().__init__()
        n = as_int("max_seq_len", max_seq_len, minimum=1)
        self.pos_w = nn.Parameter(torch.empty(2 * n - 1).normal_(std=0.02))
        self.ts_w = nn.Parameter(torch.empty(as_int("num_buckets", num_buckets) + 1).normal_(std=0.02))

    def forward(self, timestamps: torch.Tensor) -> RelativeBias:
        return RelativeBias(self.pos_w, self.ts_w, timestamps)
