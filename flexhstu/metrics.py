"""Evaluation metrics: full-corpus retrieval (HR@k, NDCG@k, MRR) and ranking (AUC, GAUC, NDCG@k of a
candidate list), and the ``--metrics`` names that choose them."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch


def target_rank(scores: torch.Tensor, target: int, seen: torch.Tensor) -> int:
    """0-based rank of ``target`` among ``scores (num_items + 1,)``, after removing the padding item 0 and the
    items in ``seen`` (the user's history; the target itself is never removed). Ties rank in the target's favour.

    Scores that are not finite never help the target: a target whose score is NaN or infinite ranks last (a
    diverged model would otherwise rank every target first, since nothing compares greater than NaN), and an
    item whose score is NaN counts as above it."""
    candidates = torch.ones_like(scores, dtype=torch.bool)
    candidates[0] = False
    candidates[seen[seen != target]] = False
    mine = scores[target]
    if not bool(torch.isfinite(mine)):
        return int(candidates.sum()) - 1
    row = scores[candidates]
    return int(((row > mine) | row.isnan()).sum())


def hit_rate_and_ndcg(ranks: list[int], k: int = 10) -> dict[str, float]:
    """``HR@k`` (share of ranks below ``k``) and ``NDCG@k`` (``1 / log2(rank + 2)`` below ``k``, else 0)."""
    if not ranks:
        raise ValueError("ranks: expected at least one rank, got none")
    hits = [r < k for r in ranks]
    gains = [1.0 / math.log2(r + 2) if r < k else 0.0 for r in ranks]
    return {f"HR@{k}": float(np.mean(hits)), f"NDCG@{k}": float(np.mean(gains))}


def mrr(ranks: list[int]) -> float:
    """Mean reciprocal rank: the mean of ``1 / (rank + 1)`` over 0-based ranks (no cut-off)."""
    if not ranks:
        raise ValueError("ranks: expected at least one rank, got none")
    return float(np.mean([1.0 / (r + 1) for r in ranks]))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve by the rank statistic (ties get average ranks); NaN if one class is absent or a
    score is not finite (NaN scores have no order: a diverged model has no AUC, not 0.25)."""
    if not np.isfinite(scores).all():
        return float("nan")
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
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * neg.sum()))


def ndcg_at(scores: np.ndarray, labels: np.ndarray, k: int = 10) -> float:
    """NDCG@k of one candidate list with binary labels; NaN without positives or with a score that is not finite
    (NaN scores have no order: the list's own order would decide)."""
    if labels.sum() == 0 or not np.isfinite(scores).all():
        return float("nan")
    top = np.argsort(-scores, kind="mergesort")[:k]
    dcg = (labels[top] / np.log2(np.arange(2, len(top) + 2))).sum()
    ideal = (1.0 / np.log2(np.arange(2, min(int(labels.sum()), k) + 2))).sum()
    return float(dcg / ideal)


def list_ndcg(scores: np.ndarray, labels: np.ndarray, list_offsets: np.ndarray, k: int = 10) -> float:
    """Mean NDCG@k over the candidate lists ``list_offsets[b]:list_offsets[b + 1]`` of ``scores, labels (C,)``;
    lists without a positive are skipped (NaN if every list is). NaN if a score is not finite: leaving out the
    lists of a diverged model would report the others as if they were all."""
    if not np.isfinite(scores).all():
        return float("nan")
    vals = [ndcg_at(scores[a:b], labels[a:b], k) for a, b in itertools.pairwise(list_offsets)]
    vals = [v for v in vals if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def gauc(scores: np.ndarray, labels: np.ndarray, group_offsets: np.ndarray) -> float:
    """Group AUC: the AUC of each group ``group_offsets[g]:group_offsets[g + 1]`` (a user's impressions),
    averaged with the group's number of impressions as its weight. Groups with one class only have no AUC
    and are skipped (NaN if every group is). NaN if a score is not finite, as ``auc``."""
    if not np.isfinite(scores).all():
        return float("nan")
    aucs, weights = [], []
    for a, b in itertools.pairwise(group_offsets):
        value = auc(scores[a:b], labels[a:b])
        if not math.isnan(value):
            aucs.append(value), weights.append(b - a)
    return float(np.average(aucs, weights=weights)) if aucs else float("nan")


RETRIEVAL_METRICS = ("hr@K", "ndcg@K", "mrr")
RANKING_METRICS = ("auc", "gauc", "ndcg@K")
DEFAULT_METRICS = {"retrieval": ("hr@10", "ndcg@10"), "ranking": ("auc", "ndcg@10")}


def parse_metrics(text: str | None, task: str) -> list[str]:
    """The metric names of ``--metrics`` (e.g. ``hr@10,ndcg@50,mrr``), lower case, after the task's defaults
    (``hr@10, ndcg@10`` for retrieval, ``auc, ndcg@10`` for ranking), each once."""
    allowed = RETRIEVAL_METRICS if task == "retrieval" else RANKING_METRICS
    names = list(DEFAULT_METRICS[task])
    for raw in (text or "").split(","):
        name = raw.strip().lower()
        if not name:
            continue
        base, _, cut = name.partition("@")
        shape = f"{base}@K" if cut else base
        if shape not in allowed or (cut and not (cut.isdigit() and int(cut) >= 1)):
            raise ValueError(
                f"--metrics: expected names from {', '.join(allowed)} (K an integer >= 1) for "
                f"{task}, got '{raw.strip()}'"
            )
        if name not in names:
            names.append(name)
    return names


def metric_key(name: str) -> str:
    """The key of a metric in results: ``hr@10`` -> ``HR@10``, ``mrr`` -> ``MRR``."""
    return name.upper()


def ranks_to_metrics(ranks: list[int], names: list[str]) -> dict[str, float]:
    """The retrieval metrics ``names`` (``hr@K``, ``ndcg@K``, ``mrr``) of 0-based target ranks."""
    out = {}
    for name in names:
        if name == "mrr":
            out["MRR"] = mrr(ranks)
        else:
            kind, k = name.split("@")
            out[metric_key(name)] = hit_rate_and_ndcg(ranks, int(k))[f"{kind.upper()}@{k}"]
    return out
