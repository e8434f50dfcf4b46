"""OneRank: task tokens after each candidate, and the per-task head and loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import bad_value
from ..jagged import can_read_values, check_offsets_meta, check_offsets_values, row_coords


@dataclass
class OneRankBatch:
    """The expanded jagged layout ``[history | (e_C, t_1 .. t_K) per candidate]``."""

    x: torch.Tensor  # (total, D)
    seq_offsets: torch.Tensor  # (B + 1,)
    num_targets: torch.Tensor  # (B,) = N_b * (K + 1)
    candidate_rows: torch.Tensor  # (C,) row of each candidate token
    task_rows: torch.Tensor  # (C, K) rows of its task tokens
    max_seq_len: int | None  # the longest sequence, read on the host; None under torch.compile (see longest)
    longest: torch.Tensor  # () int64: the longest sequence, on the device (0 for an empty batch)


class OneRankTokenizer(nn.Module):
    """Concatenates history, candidates and K learned task tokens per candidate (no replicas)."""

    def __init__(self, num_tasks: int, dim: int):
        super().__init__()
        self.tasks = nn.Parameter(torch.randn(num_tasks, dim) * dim**-0.5)

    @property
    def group_size(self) -> int:
        return self.tasks.shape[0] + 1

    def forward(
        self, history: torch.Tensor, hist_offsets: torch.Tensor, candidates: torch.Tensor, cand_offsets: torch.Tensor
    ) -> OneRankBatch:
        """history ``(T_h, D)`` jagged by ``hist_offsets``; candidates ``(C, D)`` jagged by ``cand_offsets``
        (N_b each)."""
        g = self.group_size
        k = g - 1
        for arg, offs, rows in (("hist_offsets", hist_offsets, history), ("cand_offsets", cand_offsets, candidates)):
            check_offsets_meta(offs, arg)
            if can_read_values(offs):
                check_offsets_values(offs, arg, total=rows.shape[0])
        if hist_offsets.numel() != cand_offsets.numel():
            raise bad_value(
                "cand_offsets", f"one sequence per history ({hist_offsets.numel() - 1})", cand_offsets.numel() - 1
            )
        hist_offsets = hist_offsets.to(torch.int64)
        cand_offsets = cand_offsets.to(torch.int64)
        offsets = hist_offsets + cand_offsets * g
        hist_len = hist_offsets[1:] - hist_offsets[:-1]
        n_cand = cand_offsets[1:] - cand_offsets[:-1]
        total = history.shape[0] + candidates.shape[0] * g
        dev = history.device
        # Each row's sequence by search: in bounds whatever the offsets hold (repeat_interleave with an output size
        # writes past its output when the lengths do not add up to it; the values are checked only on the CPU).
        hist_seq = row_coords(hist_offsets, history.shape[0])[0]
        hist_rows = offsets[:-1][hist_seq] + (torch.arange(history.shape[0], device=dev) - hist_offsets[:-1][hist_seq])
        cand_seq = row_coords(cand_offsets, candidates.shape[0])[0]
        local = torch.arange(candidates.shape[0], device=dev) - cand_offsets[:-1][cand_seq]
        cand_rows = offsets[:-1][cand_seq] + hist_len[cand_seq] + local * g
        task_rows = cand_rows[:, None] + 1 + torch.arange(k, device=dev)[None, :]
        x = history.new_zeros(total, history.shape[1])
        x = x.index_put((hist_rows,), history)
        x = x.index_put((cand_rows,), candidates)
        tasks = self.tasks.expand(candidates.shape[0], k, -1).reshape(-1, history.shape[1])
        x = x.index_put((task_rows.reshape(-1),), tasks)
        lengths = offsets[1:] - offsets[:-1]
        longest = lengths.max() if lengths.numel() else offsets.new_zeros(())
        # Reading it on the host is a sync, and a graph break under torch.compile: there the model scales by the
        # device value instead (OneRankModel.forward).
        max_len = None if torch.compiler.is_compiling() else int(longest)
        return OneRankBatch(x, offsets, n_cand * g, cand_rows, task_rows, max_len, longest)


class OneRankHead(nn.Module):
    """Per-task score ``s_k = <z_k, r_k> / sqrt(D) + b_k`` from the K task-token outputs ``z (C, K, D)``."""

    def __init__(self, num_tasks: int, dim: int):
        super().__init__()
        self.readout = nn.Parameter(torch.randn(num_tasks, dim) * dim**-0.5)
        self.bias = nn.Parameter(torch.zeros(num_tasks))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z * self.readout).sum(-1) / z.shape[-1] ** 0.5 + self.bias


def onerank_loss(
    scores: torch.Tensor, labels: torch.Tensor, cand_offsets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-task binary cross-entropy plus per-request, per-task list-wise InfoNCE.

    scores, labels: ``(C, K)``. InfoNCE for a request and task averages, over its positives,
    ``-log(exp(s_p) / (exp(s_p) + sum_negatives exp(s_n)))``; requests with no positive or
    no negative for a task are skipped.
    """
    bce = F.binary_cross_entropy_with_logits(scores, labels.float())
    s = scores / temperature
    nce_terms = []
    offs = cand_offsets.tolist()
    for b in range(len(offs) - 1):
        sb, lb = s[offs[b] : offs[b + 1]], labels[offs[b] : offs[b + 1]].bool()
        for t in range(scores.shape[1]):
            pos, neg = sb[lb[:, t], t], sb[~lb[:, t], t]
            if pos.numel() == 0 or neg.numel() == 0:
                continue
            neg_lse = torch.logsumexp(neg, 0)
            nce_terms.append((torch.logaddexp(pos, neg_lse) - pos).mean())
    nce = torch.stack(nce_terms).mean() if nce_terms else scores.sum() * 0.0
    return bce + nce
