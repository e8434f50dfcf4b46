"""The serving benchmark's AOTI rows: the micro-batch scorer compiled with AOTInductor, its scores and latency
against the eager scorer it was compiled from."""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..models import OneRankModel
from ..serving import HistoryCache, MicroBatchScorer, ScorerInputs, compile_scorer
from .serving_setup import (
    GROUP,
    Grid,
    Setup,
    build_model,
    free,
    latencies,
    make_candidates,
    make_histories,
    rel_diff,
    reported,
)

AOTI_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


@dataclass
class AotiRow:
    hist: int
    layers: int
    users: int
    cands: int  # per user in the micro-batch
    compile_s: float
    eager_median_ms: float | None = None
    eager_p99_ms: float | None = None
    aoti_median_ms: float | None = None
    aoti_p99_ms: float | None = None
    rel_diff: float | None = None  # AOTI against eager scores
    tolerance: float | None = None
    passed: bool | None = None
    status: str = "ok"
    part: str = "aoti"


class Package(NamedTuple):
    """One AOTInductor package of a model's micro-batch scorer, with the eager scorer it was compiled from."""

    model: OneRankModel
    scorer: MicroBatchScorer
    compiled: Callable[..., torch.Tensor]
    compile_s: float


def aoti_rows(grid: Grid, setup: Setup) -> Iterator[AotiRow]:
    """Per layer count, one AOTInductor package of the micro-batch scorer, against eager on every history,
    users and micro-batch size of the grid."""
    max_seq_len = max(grid.hist) + GROUP * max(grid.cands)
    for layers in grid.layers:
        model = build_model(setup, layers=layers, max_hist=max(grid.hist))
        scorer = MicroBatchScorer(model, max_seq_len)
        with tempfile.TemporaryDirectory() as folder:
            t0 = time.perf_counter()
            compiled = compile_scorer(
                scorer, example_inputs(model, setup, max_seq_len=max_seq_len), Path(folder) / "scorer.pt2"
            )
            package = Package(model=model, scorer=scorer, compiled=compiled, compile_s=time.perf_counter() - t0)
            for hist in grid.hist:
                for users in grid.users:
                    yield from _aoti_group(package, grid, setup, hist=hist, users=users)
                    free(setup.device)
            del package, compiled
        del model, scorer
        free(setup.device)


def example_inputs(model: OneRankModel, setup: Setup, *, max_seq_len: int) -> ScorerInputs:
    """A small request to trace the scorer with: 2 users, 16 history rows and 2 candidates each."""
    cache = HistoryCache(num_layers=len(model.stack.layers), max_seq_len=max_seq_len)
    model.cache_histories(cache, [0, 1], *make_histories(setup, users=2, hist=16))
    cand_items, _ = make_candidates(setup, users=2, cands=2)
    counts = torch.full((2,), 2, dtype=torch.int64, device=setup.device)
    return ScorerInputs.of(cache.gather([0, 1]), cand_items, counts)


def _aoti_group(package: Package, grid: Grid, setup: Setup, *, hist: int, users: int) -> Iterator[AotiRow]:
    layers = len(package.model.stack.layers)
    names = list(range(users))
    cache = HistoryCache(num_layers=layers, max_seq_len=package.scorer.max_seq_len)
    shape = dict(hist=hist, layers=layers, users=users, compile_s=package.compile_s)
    caching = AotiRow(cands=0, **shape)
    with reported(caching, setup.device):
        package.model.cache_histories(cache, names, *make_histories(setup, users=users, hist=hist))
    for cands in grid.per_user_cands():
        row = AotiRow(cands=cands, tolerance=AOTI_TOLERANCE[setup.dtype], **shape)
        if caching.status != "ok":
            row.status = f"{caching.status} (caching the histories)"
        else:
            with reported(row, setup.device):
                cand_items, _ = make_candidates(setup, users=users, cands=cands)
                counts = torch.full((users,), cands, dtype=torch.int64, device=setup.device)
                inputs = ScorerInputs.of(cache.gather(names), cand_items, counts)
                want, eager = latencies(functools.partial(package.scorer, *inputs), setup)
                got, aoti = latencies(functools.partial(package.compiled, *inputs), setup)
                row.eager_median_ms, row.eager_p99_ms = eager.median_ms, eager.p99_ms
                row.aoti_median_ms, row.aoti_p99_ms = aoti.median_ms, aoti.p99_ms
                row.rel_diff = rel_diff(got, want)
                row.passed = row.rel_diff <= row.tolerance
        yield row
