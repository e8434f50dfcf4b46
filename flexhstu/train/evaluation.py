"""Evaluation on validation or test: retrieval by full-corpus ranking (items the user has seen are excluded),
ranking per task within each candidate list, over all users or the fixed sample of ``--eval-users``; the score
that picks the best epoch; the popularity baseline, which needs no training."""

from __future__ import annotations

import argparse

import numpy as np
import torch

from .. import distributed
from ..data.sequences import UserSequences
from ..metrics import auc, gauc, list_ndcg, metric_key, ranks_to_metrics, target_rank
from ..models import Popularity, make_batch
from ..models.ranking import TASKS, RankingRequests, collate
from .splits import Splits


def retrieval_metrics(
    model,
    seqs: UserSequences,
    inputs_end: int,
    targets,
    max_len: int,
    device,
    names: tuple[str, ...] = ("hr@10", "ndcg@10"),
    users=None,
) -> dict:
    """The metrics ``names`` (``hr@K``, ``ndcg@K``, ``mrr``) by full-corpus ranking of ``users`` (default all);
    inputs are each sequence without its last ``inputs_end`` events. A model whose item table is sharded ranks
    on every rank (all must call this)."""
    if hasattr(model, "eval"):
        model.eval()
    users = range(len(seqs.items)) if users is None else users
    sharded = distributed.is_sharded(model)
    ranks = []
    for s in range(0, len(users), 256):
        chunk = users[s : s + 256]
        items = [x[: len(x) - inputs_end] for x in (seqs.items[u] for u in chunk)]
        times = [x[: len(x) - inputs_end] for x in (seqs.times[u] for u in chunk)]
        tgts = [int(targets[u]) for u in chunk]
        batch = make_batch(items, times, max_len, with_targets=False).to(device)
        if sharded:
            ranks += distributed.sharded_ranks(model, batch, tgts, items)
            continue
        scores = model.scores(batch).float().cpu()
        ranks += [target_rank(scores[r], tgt, torch.from_numpy(hist)) for r, (hist, tgt) in enumerate(zip(items, tgts))]
    return ranks_to_metrics(ranks, list(names))


def ranking_metrics(
    model, req: RankingRequests, device, names: tuple[str, ...] = ("auc", "ndcg@10"), requests=None
) -> dict:
    """Per task: AUC over all candidates, GAUC (AUC per request, weighted by its candidates), NDCG@K within
    each candidate list, as ``names`` asks; over ``requests`` (indices, default all)."""
    if requests is not None:
        req = RankingRequests(
            *([col[i] for i in requests] for col in (req.hist_items, req.hist_times, req.cand_items, req.labels))
        )
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for s in range(0, len(req.cand_items), 128):
            b = collate(req, list(range(s, min(s + 128, len(req.cand_items))))).to(device)
            scores.append(model(*b.inputs()).float().cpu().numpy()), labels.append(b.labels.cpu().numpy())
    allsc, alllab = np.concatenate(scores), np.concatenate(labels)
    starts = np.cumsum([0] + [len(c) for c in req.cand_items])
    out = {}
    for metric in names:
        for t, task in enumerate(TASKS):
            sc, lab = allsc[:, t], alllab[:, t]
            if metric == "auc":
                value = auc(sc, lab)
            elif metric == "gauc":
                value = gauc(sc, lab, starts)
            else:
                value = list_ndcg(sc, lab, starts, k=int(metric.split("@")[1]))
            out[f"{metric_key(metric)} {task}"] = value
    return out


def eval_sample(a: argparse.Namespace, n: int) -> list[int] | None:
    """The users (ranking: requests) that ``--eval-users`` keeps, the same in every epoch; None for all."""
    if not a.eval_users or a.eval_users >= n:
        return None
    return np.sort(np.random.default_rng(2**31 + 7).choice(n, size=a.eval_users, replace=False)).tolist()


def evaluate(a: argparse.Namespace, model, d: Splits, split: str, device) -> dict:
    """Metrics on ``split`` ("valid" or "test")."""
    if a.task == "retrieval":
        inputs_end, targets = (2, d.valid) if split == "valid" else (1, d.test)
        return retrieval_metrics(
            model, d.seqs, inputs_end, targets, a.max_len, device, a.metric_names, eval_sample(a, len(d.seqs.items))
        )
    req = d.valid if split == "valid" else d.test
    return ranking_metrics(model, req, device, a.metric_names, eval_sample(a, len(req.cand_items)))


def validation_score(a: argparse.Namespace, record: dict) -> float:
    """What picks the best epoch: NDCG@10 for retrieval, the mean AUC over tasks for ranking."""
    if a.task == "retrieval":
        return record["valid NDCG@10"]
    return float(np.nanmean([record[f"valid AUC {t}"] for t in TASKS]))


def run_popularity(a: argparse.Namespace, d: Splits) -> dict:
    """The popularity baseline needs no training: counts over the training (then training + validation) events."""
    names = a.metric_names
    valid = retrieval_metrics(Popularity(d.train_items, d.num_items), d.seqs, 2, d.valid, a.max_len, "cpu", names)
    pop = Popularity([x[:-1] for x in d.seqs.items], d.num_items)
    return {"valid": valid, "test": retrieval_metrics(pop, d.seqs, 1, d.test, a.max_len, "cpu", names)}
