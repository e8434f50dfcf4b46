"""One candidate micro-batch as an exportable module (``torch.export``; AOTInductor on the GPU)."""

from __future__ import annotations

import torch
from torch import nn

from .cache import JaggedHistory


class MicroBatchScorer(nn.Module):
    """``forward(ks, vs, hist_offsets, cand_items, counts) -> (c, tasks)`` scores of one micro-batch.

    ``ks``, ``vs``: per-layer cached history ``k (T_h, H, Dqk)``, ``v (T_h, H, Dv)`` (``HistoryCache.gather``);
    ``hist_offsets (B + 1,)``; ``cand_items (c,)``; ``counts (B,)`` candidates per user. Runs under no_grad,
    reads no tensor on the host, so ``torch.export.export(scorer, args)`` traces it (the custom ops carry fakes).
    """

    def __init__(self, model: nn.Module, max_seq_len: int):
        super().__init__()
        self.model, self.max_seq_len = model, max_seq_len

    def forward(self, ks: tuple[torch.Tensor, ...], vs: tuple[torch.Tensor, ...], hist_offsets: torch.Tensor,
                cand_items: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            history = JaggedHistory(list(ks), list(vs), hist_offsets, [])
            return self.model.score_micro_batch(history, cand_items, counts, self.max_seq_len)
