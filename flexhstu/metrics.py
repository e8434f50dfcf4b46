"""Evaluation metrics: full-corpus retrieval (HR@k, NDCG@k) and ranking (AUC, NDCG@k of a candidate list)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch


def target_rank(scores: torch.Tensor, target: int, seen: torch.Tensor) -> int:
    """0-based rank of ``target`` among ``scores (num_items + 1,)``, after removing the padding item 0 and the
    items in ``seen`` (the user's history; the target itself is never removed). Ties rank in the target's favour."""
    row = scores.clone()
    row[0] = -math.inf
    row[seen[seen != target]] = -math.inf
    return int((row > row[target]).sum())


def hit_rate_and_ndcg(ranks: list[int], k: int = 10) -> dict[str, float]:
    """``HR@k`` (share of ranks below ``k``) and ``NDCG@k`` (``1 / log2(rank + 2)`` below ``k``, else 0)."""
    if not ranks:
        raise ValueError("ranks: expected at least one rank, got none")
    hits = [r < k for r in ranks]
    gains = [1.0 / math.log2(r + 2) if r < k else 0.0 for r in ranks]
    return {f"HR@{k}": float(np.mean(hits)), f"NDCG@{k}": float(np.mean(gains))}


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


def list_ndcg(scores: np.ndarray, labels: np.ndarray, list_offsets: np.ndarray, k: int = 10) -> float:
    """Mean NDCG@k over the candidate lists ``list_offsets[b]:list_offsets[b + 1]`` of ``scores, labels (C,)``;
    lists without a positive are skipped (NaN if every list is)."""
    vals = [ndcg_at(scores[a:b], labels[a:b], k) for a, b in itertools.pairwise(list_offsets)]
    vals = [v for v in vals if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")
