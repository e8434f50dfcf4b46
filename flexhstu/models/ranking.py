"""Multi-task ranking with OneRank: history, then candidates each followed by K task tokens.

MovieLens tasks: watched (a real next interaction vs a sampled unwatched item), rated >= 4, rated 5.
The ablation replaces task tokens with one plain target token per candidate under the fixed
targets mask (targets see the history and themselves), read out by the same per-task head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import masks
from ..nn import InputEncoder, OneRankHead, OneRankTokenizer, STULayerConfig, STUStack
from ..ops import Kernel

TASKS = ("watched", "rated>=4", "rated5")


@dataclass
class RankingRequests:
    """Requests: a history and a candidate list with (C, 3) labels each."""

    hist_items: list[np.ndarray]
    hist_times: list[np.ndarray]
    cand_items: list[np.ndarray]
    labels: list[np.ndarray]


def _request(items, ratings, times, cut, n_pos, n_neg, rng, num_items, max_len):
    pos = items[cut:cut + n_pos]
    seen = set(items.tolist())
    neg = []
    while len(neg) < n_neg:
        x = int(rng.integers(1, num_items + 1))
        if x not in seen:
            neg.append(x)
    r = ratings[cut:cut + n_pos]
    lab_pos = np.stack([np.ones(len(pos)), r >= 4, r >= 5], axis=1)
    cand = np.concatenate([pos, np.array(neg, dtype=np.int64)])
    labels = np.concatenate([lab_pos, np.zeros((n_neg, 3))]).astype(np.float32)
    order = rng.permutation(len(cand))
    return items[:cut][-max_len:], times[:cut][-max_len:], cand[order], labels[order]


def make_requests(seqs, split: str, n_pos: int = 5, n_neg: int = 5, per_user: int = 2, max_len: int = 200,
                  seed: int = 0) -> RankingRequests:
    """``test``: each user's last ``n_pos`` events; ``valid``: the ``n_pos`` before them;
    ``train``: ``per_user`` random cut points that end before the validation window."""
    rng = np.random.default_rng(seed)
    out = RankingRequests([], [], [], [])
    for items, ratings, times in zip(seqs.items, seqs.ratings, seqs.times):
        L = len(items)
        if L < 3 * n_pos + 2:
            continue
        if split == "test":
            cuts = [L - n_pos]
        elif split == "valid":
            cuts = [L - 2 * n_pos]
        else:
            cuts = rng.integers(2, L - 3 * n_pos + 1, size=per_user).tolist()
        for c in cuts:
            h, t, cand, lab = _request(items, ratings, times, c, n_pos, n_neg, rng, seqs.num_items, max_len)
            out.hist_items.append(h), out.hist_times.append(t), out.cand_items.append(cand), out.labels.append(lab)
    return out


class OneRankModel(nn.Module):
    def __init__(self, num_items: int, dim: int = 64, layers: int = 2, heads: int = 2, max_len: int = 200,
                 task_tokens: bool = True, dropout: float = 0.2, kernel: Kernel = Kernel.AUTO):
        super().__init__()
        k = len(TASKS)
        self.encoder = InputEncoder(num_items, dim, max_len)
        self.tokenizer = OneRankTokenizer(k if task_tokens else 0, dim)
        self.stack = STUStack(STULayerConfig(dim, heads, dim // heads, dim // heads, dropout, kernel), layers)
        self.head = OneRankHead(k, dim)
        self.task_tokens = task_tokens
        self.dropout = nn.Dropout(dropout)

    def forward(self, req: RankingRequests, idx: list[int], device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores and labels ``(C, K)`` for requests ``idx``, and the candidate offsets."""
        hi = [req.hist_items[i] for i in idx]
        hoffs = torch.tensor(np.concatenate([[0], np.cumsum([len(h) for h in hi])]), device=device)
        coffs = torch.tensor(np.concatenate([[0], np.cumsum([len(req.cand_items[i]) for i in idx])]), device=device)
        hist = self.encoder(torch.from_numpy(np.concatenate(hi)).to(device),
                            torch.from_numpy(np.concatenate([req.hist_times[i] for i in idx])).to(device), hoffs)
        cand = self.encoder.items(torch.from_numpy(np.concatenate([req.cand_items[i] for i in idx])).to(device))
        b = self.tokenizer(self.dropout(hist), hoffs, cand, coffs)
        if self.task_tokens:
            func = masks.onerank(b.seq_offsets, b.num_targets, self.tokenizer.group_size, total=b.x.shape[0], _check=False)
            out = self.stack(b.x, b.seq_offsets, b.max_seq_len, attn_func=func)
            z = out[b.task_rows]
        else:
            out = self.stack(b.x, b.seq_offsets, b.max_seq_len, num_targets=b.num_targets)
            z = out[b.candidate_rows][:, None, :].expand(-1, len(TASKS), -1)
        labels = torch.from_numpy(np.concatenate([req.labels[i] for i in idx])).to(device)
        return self.head(z), labels, coffs


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve by the rank statistic (ties get average ranks); NaN if one class is absent."""
    pos, neg = labels > 0.5, labels <= 0.5
    if pos.sum() == 0 or neg.sum() == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    s = scores[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * neg.sum()))


def ndcg_at(scores: np.ndarray, labels: np.ndarray, k: int = 10) -> float:
    """NDCG@k of one candidate list with binary labels; NaN without positives."""
    if labels.sum() == 0:
        return float("nan")
    top = np.argsort(-scores, kind="mergesort")[:k]
    dcg = (labels[top] / np.log2(np.arange(2, len(top) + 2))).sum()
    ideal = (1.0 / np.log2(np.arange(2, min(int(labels.sum()), k) + 2))).sum()
    return float(dcg / ideal)
