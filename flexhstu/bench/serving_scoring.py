"""The serving benchmark's scoring rows: a request scored from the users' cached histories (with and without
CUDA graphs), against the full recompute of history and candidates (in one forward, or one per micro-batch)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .. import serving
from ..models import OneRankModel
from ..serving import HistoryCache
from .serving_setup import (
    GROUP,
    Grid,
    Histories,
    Setup,
    build_model,
    free,
    latencies,
    make_candidates,
    make_histories,
    rel_diff,
    reported,
)
from .timing import Latency


@dataclass
class ScoringRow:
    # "cached" (CUDA graphs as the default takes them), "cached, eager", "cached, graphs" or "full" (micro_batch
    # None: one forward; m: one per micro-batch)
    path: str
    hist: int
    cands: int  # per user
    layers: int
    users: int
    micro_batch: int | None  # candidates per user per delta call; None: all (and for "full")
    median_ms: float | None = None
    p99_ms: float | None = None
    samples: int = 0
    host_ms: float | None = None  # median time until the request returned to the host
    cands_per_s: float | None = None
    rel_diff: float | None = None  # cached: against the full recompute's scores
    status: str = "ok"
    part: str = "scoring"


def scoring_rows(grid: Grid, setup: Setup) -> Iterator[ScoringRow]:
    """Full recompute and cached scoring, per layers, history, users, candidates and micro-batch size."""
    for layers in grid.layers:
        model = build_model(setup, layers=layers, max_hist=max(grid.hist))
        for hist in grid.hist:
            for users in grid.users:
                yield from _scoring_group(model, grid, setup, hist=hist, users=users)
                free(setup.device)  # the group's cache is gone with its frame
        del model
        free(setup.device)


def _scoring_group(model: OneRankModel, grid: Grid, setup: Setup, *, hist: int, users: int) -> Iterator[ScoringRow]:
    layers = len(model.stack.layers)
    max_seq_len = hist + GROUP * max(grid.cands)  # the cache's bound and attention scale, also the full run's
    histories = make_histories(setup, users=users, hist=hist)
    names = list(range(users))
    cache = HistoryCache(num_layers=layers, max_seq_len=max_seq_len)
    caching = ScoringRow(path="cached", hist=hist, cands=0, layers=layers, users=users, micro_batch=None)
    with reported(caching, setup.device):
        model.cache_histories(cache, names, *histories)
    for cands in grid.cands:
        cand_items, cand_offsets = make_candidates(setup, users=users, cands=cands)
        full = ScoringRow(path="full", hist=hist, cands=cands, layers=layers, users=users, micro_batch=None)
        full_scores = None
        with reported(full, setup.device), torch.no_grad():
            full_scores, lat = latencies(
                functools.partial(model, *histories, cand_items, cand_offsets, max_seq_len=max_seq_len), setup
            )
            _fill(full, lat, cands=users * cands)
        yield full
        for micro_batch in (m for m in grid.micro_batch if m is not None and m < cands):
            row = ScoringRow(path="full", hist=hist, cands=cands, layers=layers, users=users, micro_batch=micro_batch)
            with reported(row, setup.device), torch.no_grad():
                scores, lat = latencies(
                    functools.partial(
                        _full_per_micro_batch, model, histories, cand_items, cand_offsets, micro_batch, max_seq_len
                    ),
                    setup,
                )
                _fill(row, lat, cands=users * cands)
                if full_scores is not None:
                    row.rel_diff = rel_diff(scores, full_scores)
            yield row

        # On CUDA, micro-batched requests also run without CUDA graphs ("cached, eager": what the graphs save),
        # and with them forced where the default does not take them ("cached, graphs": above GRAPH_MAX_ROWS).
        def cuda_paths(m: int, cands: int = cands) -> tuple[str, ...]:
            over = users * min(m, cands) * GROUP > serving.GRAPH_MAX_ROWS
            return ("cached, eager", "cached", "cached, graphs") if over else ("cached, eager", "cached")

        # "cached, e4m3": the default path with the attention in e4m3 (score_cached(fp8=True)).
        paths = [
            (m, p)
            for m in grid.micro_batch
            for p in (
                *(cuda_paths(m) if m is not None and setup.device.type == "cuda" else ("cached",)),
                "cached, e4m3",
            )
        ]
        for micro_batch, path in paths:
            row = ScoringRow(path=path, hist=hist, cands=cands, layers=layers, users=users, micro_batch=micro_batch)
            if caching.status != "ok":
                row.status = f"{caching.status} (caching the histories)"
            else:
                with reported(row, setup.device):
                    graphs = {"cached, eager": False, "cached, graphs": True}.get(path)
                    scores, lat = latencies(
                        functools.partial(
                            model.score_cached,
                            cache,
                            names,
                            cand_items,
                            cand_offsets,
                            micro_batch=micro_batch,
                            cuda_graphs=graphs,
                            fp8=path == "cached, e4m3",
                        ),
                        setup,
                    )
                    _fill(row, lat, cands=users * cands)
                    if full_scores is not None:
                        row.rel_diff = rel_diff(scores, full_scores)
            yield row


def _full_per_micro_batch(
    model: OneRankModel,
    histories: Histories,
    cand_items: torch.Tensor,
    cand_offsets: torch.Tensor,
    micro_batch: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Scores with no cache, ``micro_batch`` candidates per user at a time: the histories run every time."""
    scores = None
    for mb in serving.micro_batches(cand_offsets, micro_batch):
        offsets = torch.cat([mb.counts_tensor.new_zeros(1), mb.counts_tensor.cumsum(0)])
        got = model(*histories, cand_items[mb.index], offsets, max_seq_len=max_seq_len)
        scores = got.new_zeros(cand_items.shape[0], got.shape[1]) if scores is None else scores
        scores.index_copy_(0, mb.index, got)
    return scores


def _fill(row: ScoringRow, lat: Latency, *, cands: int) -> None:
    row.median_ms, row.p99_ms, row.samples, row.host_ms = lat
    row.cands_per_s = cands / (lat.median_ms / 1e3)
