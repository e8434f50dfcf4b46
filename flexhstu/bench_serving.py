"""Serving benchmark: cached delta scoring of OneRank candidates against a full recompute, on a CUDA GPU.

Every user has a history of ``--hist`` tokens and ``--cands`` candidates; a candidate is a group of 4 tokens
(the candidate and the model's three task tokens, OneRank). The model is ``OneRankModel`` with random
weights: ``--layers`` STU layers of width ``--dim`` and ``--heads`` heads.

**Scoring** rows, one per configuration and path:

* ``cached``: the users' histories are cached once (``cache_histories``), outside the timed region; a sample
  is one ``score_cached`` call: the request's histories gathered, then one delta attention call per layer and
  micro-batch of ``--micro-batch`` candidates per user (``all``: every candidate at once), micro-batches of one
  size replayed from a CUDA graph when there are three or more (the default); ``cached, eager``: the same
  without CUDA graphs (on CUDA, micro-batched rows only);
* ``full``: a sample is the model's forward over history and candidates, what serving without a cache runs
  (micro-batch ``-``: every candidate in one forward; ``m``: one forward per micro-batch of ``m`` candidates per
  user, each recomputing the histories: what a server that cannot hold a request's candidates at once pays).

A sample is one request, timed with CUDA events from an idle device (synchronised before each) after
``--warmup`` calls. Rows give the median and p99 (nearest rank) latency of ``--samples`` samples,
candidates per second (``users * cands / median``) and ``rel diff``: the largest difference between the
cached and the full recompute's scores, over the largest full score (both paths must give the same scores).
Both paths run eager PyTorch around the Triton kernels (the STU layers are built with ``compile=False``),
so they compare the work each path does.

**Kernel** rows, one per history, micro-batch size ``m`` and number of users: the attention of one
micro-batch (the ``4 m`` rows of each user's candidates as queries, against the history and those rows)
with the model's heads and head dim. TFLOP/s on visible pairs, counted exactly (``masks.count_visible``;
a forward is ``4 * pairs * D``), from device time (CUDA-graph replays, ``triton.testing.do_bench``):

* ``delta``: ``delta_hstu_mha`` on the query rows;
* ``full, same pairs``: the training forward kernel (``hstu_mha``) on the whole sequences, under a func that
  gives history rows no keys: exactly the delta's pairs, so the two times compare directly;
* ``full, onerank``: ``hstu_mha`` on the whole sequences under the OneRank func (history rows included),
  the attention of a full recompute.

**AOTI** (``--aoti``, instead of the above): per layer count, one micro-batch module
(``serving.MicroBatchScorer``) exported with dynamic sizes and compiled with AOTInductor
(``serving.compile_scorer``); per history, users and micro-batch size, its scores are compared with eager
(largest difference over the largest eager score: at most 1e-2 in half precision, 1e-5 in float32; exit
status 1 otherwise) and both are timed as above.

An out-of-memory error or an input the library refuses is reported in the row's status, not raised.
``--json`` is rewritten after every row, so an interrupted run keeps what it measured.

    python -m flexhstu.bench_serving --quick --json serving.json     # history 16384, 2048 candidates, 4 layers
    python -m flexhstu.bench_serving --hist 4096 --json serving-4k.json   # a slice of the full grid
    python -m flexhstu.bench_serving --aoti --quick --json aoti.json
    flexhstu bench --serving --quick                                 # the same, through the command
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from . import Kernel, delta_hstu_mha, hstu_mha, masks, serving
from .cli.common import Parser, non_negative_int, positive_int
from .jagged import offsets_from_lengths, row_coords
from .models import OneRankModel
from .models.ranking import TASKS
from .serving import HistoryCache, MicroBatchScorer, ScorerInputs, compile_scorer

GROUP = len(TASKS) + 1  # tokens per candidate: the candidate and its task tokens
ITEMS = 10_000  # catalogue size of the random model (the embedding table is not what is measured)
AOTI_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


class Setup(NamedTuple):
    """What every configuration shares: device, dtype, attention backend, model width and heads, timing."""

    device: torch.device
    dtype: torch.dtype
    backend: Kernel
    dim: int
    heads: int
    samples: int
    warmup: int
    seed: int


class Grid(NamedTuple):
    """The configurations: every combination of these (micro-batch ``None``: all candidates at once)."""

    hist: list[int]  # history tokens per user
    cands: list[int]  # candidates per user
    micro_batch: list[int | None]  # candidates per user per delta call
    layers: list[int]
    users: list[int]

    def per_user_cands(self) -> list[int]:
        """Candidates per user in one micro-batch, over the grid: ``min(m, c)`` (``all``: ``c``)."""
        return sorted({c if m is None else min(m, c) for m in self.micro_batch for c in self.cands})


FULL = Grid(hist=[4096, 16384], cands=[512, 2048], micro_batch=[64, 256, None], layers=[2, 4, 8], users=[1, 8, 32])
QUICK = Grid(hist=[16384], cands=[2048], micro_batch=[256, None], layers=[4], users=[1, 8])


class Latency(NamedTuple):
    median_ms: float
    p99_ms: float
    samples: int


@dataclass
class ScoringRow:
    path: str  # "cached", "cached, eager" or "full" (micro_batch None: one forward; m: one per micro-batch)
    hist: int
    cands: int  # per user
    layers: int
    users: int
    micro_batch: int | None  # candidates per user per delta call; None: all (and for "full")
    median_ms: float | None = None
    p99_ms: float | None = None
    samples: int = 0
    cands_per_s: float | None = None
    rel_diff: float | None = None  # cached: against the full recompute's scores
    status: str = "ok"
    part: str = "scoring"


@dataclass
class KernelRow:
    kernel: str  # "delta", "full, same pairs", "full, onerank"
    hist: int
    cands: int  # per user in the micro-batch: 4x as many query rows
    users: int
    heads: int
    head_dim: int
    pairs: int | None = None  # visible (query, key) pairs, all heads
    ms: float | None = None  # device time: median of CUDA-graph replays (CPU: wall time)
    tflops: float | None = None  # 4 * pairs * head_dim / time
    eager_ms: float | None = None  # an eager call, host work included
    status: str = "ok"
    part: str = "kernel"


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


# ---------------------------------------------------------------------------------------------------------------
# Inputs: the model, the users' histories and candidates


def build_model(setup: Setup, *, layers: int, max_hist: int) -> OneRankModel:
    """A OneRank model with random weights, eval mode, on the setup's device and dtype; eager STU layers."""
    torch.manual_seed(setup.seed)
    model = OneRankModel(ITEMS, dim=setup.dim, layers=layers, heads=setup.heads, max_len=max_hist, dropout=0.0,
                         kernel=setup.backend)
    eager = dataclasses.replace(model.stack.layers[0].cfg, compile=False)  # both paths eager around the kernels
    for layer in model.stack.layers:
        layer.cfg = eager
    return model.to(device=setup.device, dtype=setup.dtype).eval()


class Histories(NamedTuple):
    """``items, times (users * hist,)`` jagged by ``offsets (users + 1,)``, on the device."""

    items: torch.Tensor
    times: torch.Tensor
    offsets: torch.Tensor


def make_histories(setup: Setup, *, users: int, hist: int) -> Histories:
    g = torch.Generator().manual_seed(setup.seed)
    items = torch.randint(1, ITEMS + 1, (users * hist,), generator=g)
    times = torch.arange(hist).repeat(users) * 60  # one event a minute
    offsets = offsets_from_lengths([hist] * users)
    return Histories(*(t.to(setup.device) for t in (items, times, offsets)))


def make_candidates(setup: Setup, *, users: int, cands: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cand_items (users * cands,)`` and ``cand_offsets (users + 1,)``, on the device."""
    g = torch.Generator().manual_seed(setup.seed + 1)
    items = torch.randint(1, ITEMS + 1, (users * cands,), generator=g)
    return items.to(setup.device), offsets_from_lengths([cands] * users, device=setup.device)


# ---------------------------------------------------------------------------------------------------------------
# Timing


def latencies(call: Callable[[], object], setup: Setup) -> tuple[object, Latency]:
    """``call``'s last output and its latency: ``setup.warmup`` calls, then ``setup.samples`` calls, each timed
    with CUDA events from an idle device (CPU: wall time)."""
    out = None
    for _ in range(setup.warmup):
        out = call()
    times = []
    for _ in range(setup.samples):
        if setup.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(setup.device)
            start.record()
            out = call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = call()
            times.append((time.perf_counter() - t0) * 1e3)
    ordered = sorted(times)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]  # nearest rank
    return out, Latency(statistics.median(ordered), p99, len(ordered))


def device_ms(call: Callable[[], object], setup: Setup) -> tuple[float, float]:
    """(device time, eager time) of ``call`` in ms: on CUDA the medians of ``triton.testing.do_bench`` over a
    CUDA-graph replay of the call and over the call itself; on the CPU both are wall time."""
    if setup.device.type != "cuda":
        _, lat = latencies(call, setup)
        return lat.median_ms, lat.median_ms
    import triton.testing

    from .bench import captured

    replay = captured(call)  # warm-up (compiles the kernels) off the capture stream, then the capture
    graph_ms = triton.testing.do_bench(replay, return_mode="median")
    eager_ms = triton.testing.do_bench(call, return_mode="median")
    del replay  # the graph and its memory pool
    return graph_ms, eager_ms


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float32."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float32).tiny))


@contextmanager
def reported(row, device: torch.device) -> Iterator[None]:
    """Runs the block that fills ``row``; an out-of-memory error or an input the library refuses (ValueError,
    ``arg: expected X, got Y``) ends the block and becomes the row's status. Anything else is a bug: raised."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        row.status = "oom"
    except ValueError as e:
        row.status = f"unsupported: {e}"
    if row.status != "ok":
        free(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# The three parts


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
            full_scores, lat = latencies(functools.partial(model, *histories, cand_items, cand_offsets,
                                                           max_seq_len=max_seq_len), setup)
            _fill(full, lat, cands=users * cands)
        yield full
        for micro_batch in (m for m in grid.micro_batch if m is not None and m < cands):
            row = ScoringRow(path="full", hist=hist, cands=cands, layers=layers, users=users, micro_batch=micro_batch)
            with reported(row, setup.device), torch.no_grad():
                scores, lat = latencies(functools.partial(_full_per_micro_batch, model, histories, cand_items,
                                                          cand_offsets, micro_batch, max_seq_len), setup)
                _fill(row, lat, cands=users * cands)
                if full_scores is not None:
                    row.rel_diff = rel_diff(scores, full_scores)
            yield row
        # On CUDA, micro-batched requests also run without CUDA graphs ("cached, eager"): what the graphs save.
        both = ("cached, eager", "cached")
        paths = [(m, p) for m in grid.micro_batch
                 for p in (both if m is not None and setup.device.type == "cuda" else ("cached",))]
        for micro_batch, path in paths:
            row = ScoringRow(path=path, hist=hist, cands=cands, layers=layers, users=users, micro_batch=micro_batch)
            if caching.status != "ok":
                row.status = f"{caching.status} (caching the histories)"
            else:
                with reported(row, setup.device):
                    graphs = False if path == "cached, eager" else None
                    scores, lat = latencies(functools.partial(model.score_cached, cache, names, cand_items,
                                                              cand_offsets, micro_batch=micro_batch,
                                                              cuda_graphs=graphs), setup)
                    _fill(row, lat, cands=users * cands)
                    if full_scores is not None:
                        row.rel_diff = rel_diff(scores, full_scores)
            yield row


def _full_per_micro_batch(model: OneRankModel, histories: Histories, cand_items: torch.Tensor,
                          cand_offsets: torch.Tensor, micro_batch: int, max_seq_len: int) -> torch.Tensor:
    """Scores with no cache, ``micro_batch`` candidates per user at a time: the histories run every time."""
    scores = None
    for mb in serving.micro_batches(cand_offsets, micro_batch):
        offsets = torch.cat([mb.counts_tensor.new_zeros(1), mb.counts_tensor.cumsum(0)])
        got = model(*histories, cand_items[mb.index], offsets, max_seq_len=max_seq_len)
        scores = got.new_zeros(cand_items.shape[0], got.shape[1]) if scores is None else scores
        scores.index_copy_(0, mb.index, got)
    return scores


def _fill(row: ScoringRow, lat: Latency, *, cands: int) -> None:
    row.median_ms, row.p99_ms, row.samples = lat
    row.cands_per_s = cands / (lat.median_ms / 1e3)


def kernel_rows(grid: Grid, setup: Setup) -> Iterator[KernelRow]:
    """The delta kernel against the training forward kernel, per history, users and micro-batch size."""
    for hist in grid.hist:
        for users in grid.users:
            for cands in grid.per_user_cands():
                yield from _kernel_case(setup, hist=hist, cands=cands, users=users)
                free(setup.device)


class KernelCalls(NamedTuple):
    """The three attention calls of one kernel case and the visible pairs (all heads) of each."""

    calls: dict[str, Callable[[], torch.Tensor]]
    pairs: dict[str, int]


def kernel_calls(setup: Setup, *, hist: int, cands: int, users: int) -> KernelCalls:
    """``users`` sequences of ``hist`` history rows and ``cands`` candidate groups under the OneRank func; the
    delta call takes the groups' rows as queries (the last ``4 * cands`` rows of every sequence)."""
    heads, head_dim = setup.heads, setup.dim // setup.heads
    length = hist + GROUP * cands
    offs = offsets_from_lengths([length] * users, device=setup.device)
    total = users * length
    g = torch.Generator(device=setup.device).manual_seed(setup.seed)
    q, k, v = (torch.randn(total, heads, head_dim, device=setup.device, dtype=setup.dtype, generator=g)
               for _ in range(3))
    targets = torch.full((users,), GROUP * cands, dtype=torch.int64, device=setup.device)
    func = masks.onerank(offs, targets, GROUP, total=total)  # (1, 5, total)
    _, local, _ = row_coords(offs, total)
    history_row = local < hist
    same_pairs = torch.where(history_row, 0, func)  # history rows: every interval [0, 0), no keys
    new_rows = torch.nonzero(~history_row).squeeze(1)  # the groups' rows, user by user
    delta_q, delta_func = q[new_rows].contiguous(), func[:, :, new_rows].contiguous()
    calls = {
        "delta": functools.partial(delta_hstu_mha, length, None, delta_q, k, v, offs, attn_func=delta_func,
                                   kernel=setup.backend),
        "full, same pairs": functools.partial(hstu_mha, length, None, q, k, v, offs, attn_func=same_pairs,
                                              kernel=setup.backend),
        "full, onerank": functools.partial(hstu_mha, length, None, q, k, v, offs, attn_func=func,
                                           kernel=setup.backend),
    }
    counted = {name: int(masks.count_visible(f, offs).sum()) * heads
               for name, f in (("same", same_pairs), ("onerank", func))}
    pairs = {"delta": counted["same"], "full, same pairs": counted["same"], "full, onerank": counted["onerank"]}
    return KernelCalls(calls, pairs)


def _kernel_case(setup: Setup, *, hist: int, cands: int, users: int) -> Iterator[KernelRow]:
    shape = dict(hist=hist, cands=cands, users=users, heads=setup.heads, head_dim=setup.dim // setup.heads)
    rows = [KernelRow(kernel=name, **shape) for name in ("delta", "full, same pairs", "full, onerank")]
    building, case = KernelRow(kernel="inputs", **shape), None
    with reported(building, setup.device):
        case = kernel_calls(setup, hist=hist, cands=cands, users=users)
    for row in rows:
        if case is None:
            row.status = f"{building.status} (building the inputs)"
        else:
            row.pairs = case.pairs[row.kernel]
            with reported(row, setup.device), torch.no_grad():
                row.ms, row.eager_ms = device_ms(case.calls[row.kernel], setup)
                row.tflops = 4 * row.pairs * row.head_dim / (row.ms * 1e9)
        yield row


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
            compiled = compile_scorer(scorer, example_inputs(model, setup, max_seq_len=max_seq_len),
                                      Path(folder) / "scorer.pt2")
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


# ---------------------------------------------------------------------------------------------------------------
# Tables and the command


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def scoring_table(rows: list[ScoringRow]) -> str:
    """Speed-ups of every row against the full recompute in one forward, and of cached rows against the full
    recompute at the same micro-batch size (``-`` where there is none)."""
    full = {(r.hist, r.cands, r.layers, r.users, r.micro_batch): r.median_ms for r in rows if r.path == "full"}
    lines = ["| history | cands/user | layers | users | path | micro-batch | median ms | p99 ms | cands/s "
             "| speed-up vs full | vs full, same micro-batch | rel diff | status |", "|" + "---|" * 13]
    for r in rows:
        key = (r.hist, r.cands, r.layers, r.users)
        base, same = full.get((*key, None)), full.get((*key, r.micro_batch))
        speed = base / r.median_ms if base and r.median_ms else None
        cached = r.path.startswith("cached")
        speed_same = same / r.median_ms if cached and r.micro_batch and same and r.median_ms else None
        mb = ("-" if r.path == "full" else "all") if r.micro_batch is None else str(r.micro_batch)
        lines.append(f"| {r.hist} | {r.cands} | {r.layers} | {r.users} | {r.path} | {mb} | {_f(r.median_ms, '.2f')} "
                     f"| {_f(r.p99_ms, '.2f')} | {_f(r.cands_per_s, ',.0f')} | {_f(speed, '.2f')} "
                     f"| {_f(speed_same, '.2f')} | {_f(r.rel_diff, '.1e')} | {r.status} |")
    return "\n".join(lines)


def kernel_table(rows: list[KernelRow]) -> str:
    lines = ["| history | cands/user | users | kernel | pairs (M) | device ms | TFLOP/s | eager ms | status |",
             "|" + "---|" * 9]
    for r in rows:
        pairs = None if r.pairs is None else r.pairs / 1e6
        lines.append(f"| {r.hist} | {r.cands} | {r.users} | {r.kernel} | {_f(pairs, '.1f')} | {_f(r.ms, '.3f')} "
                     f"| {_f(r.tflops, '.0f')} | {_f(r.eager_ms, '.3f')} | {r.status} |")
    return "\n".join(lines)


def aoti_table(rows: list[AotiRow]) -> str:
    lines = ["| history | layers | users | cands/user | eager median ms | eager p99 ms | AOTI median ms | AOTI p99 ms "
             "| speed-up | rel diff | check | compile s | status |", "|" + "---|" * 13]
    for r in rows:
        speed = r.eager_median_ms / r.aoti_median_ms if r.eager_median_ms and r.aoti_median_ms else None
        check = "-" if r.passed is None else ("pass" if r.passed else f"FAIL (> {r.tolerance:g})")
        lines.append(f"| {r.hist} | {r.layers} | {r.users} | {r.cands} | {_f(r.eager_median_ms, '.2f')} "
                     f"| {_f(r.eager_p99_ms, '.2f')} | {_f(r.aoti_median_ms, '.2f')} | {_f(r.aoti_p99_ms, '.2f')} "
                     f"| {_f(speed, '.2f')} | {_f(r.rel_diff, '.1e')} | {check} | {r.compile_s:.0f} | {r.status} |")
    return "\n".join(lines)


def positive_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, e.g. ``4096,16384``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got '{text}'")
    return [positive_int(x) for x in parts]


def micro_batch_list(text: str) -> list[int | None]:
    """argparse type: comma-separated micro-batch sizes, integers >= 1 or ``all``, e.g. ``64,256,all``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or any(x != "all" and not (x.isdigit() and int(x) >= 1) for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 or 'all', got '{text}'")
    return [None if x == "all" else int(x) for x in parts]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="flexhstu bench --serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a representative subset: history 16384, 2048 candidates, "
                   "4 layers, micro-batches 256 and all, 1 and 8 users (options given still apply)")
    p.add_argument("--aoti", action="store_true", help="compare an AOTInductor-compiled micro-batch with eager")
    p.add_argument("--part", choices=["all", "scoring", "kernel"], default="all",
                   help="without --aoti: the scoring rows, the kernel rows, or both")
    p.add_argument("--hist", type=positive_list, default=None, help="history lengths (default 4096,16384)")
    p.add_argument("--cands", type=positive_list, default=None, help="candidates per user (default 512,2048)")
    p.add_argument("--micro-batch", type=micro_batch_list, default=None,
                   help="candidates per user per delta call, or all (default 64,256,all)")
    p.add_argument("--layers", type=positive_list, default=None, help="STU layers (default 2,4,8)")
    p.add_argument("--users", type=positive_list, default=None, help="users per request (default 1,8,32)")
    p.add_argument("--dim", type=positive_int, default=512, help="embedding dim of the model")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (head dim: dim / heads)")
    p.add_argument("--samples", type=positive_int, default=30, help="timed requests per row")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed requests before them")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--backend", choices=["triton", "pytorch"], default="triton",
                   help="the attention kernels (pytorch: the reference)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only runs the code path (for tests)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", default="", help="also write the rows here (rewritten after every row)")
    a = p.parse_args(argv)
    defaults = QUICK if a.quick else FULL
    for name in Grid._fields:
        if getattr(a, name) is None:
            setattr(a, name, getattr(defaults, name))
    if a.dim % a.heads:
        p.error(f"--heads: expected a divisor of --dim {a.dim}, got {a.heads}")
    if a.device not in ("cuda", "cpu"):
        p.error(f"--device: expected cuda or cpu, got '{a.device}'")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device: expected a CUDA GPU, found none (--device cpu only runs the code path, for tests)")
    return a


def progress(row) -> str:
    """One line per finished row: its fields (floats to 4 digits), then its status."""
    fields = asdict(row)
    if fields.get("path") == "cached" and fields.get("cands") and fields["micro_batch"] is None:
        fields["micro_batch"] = "all"
    shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
             if k not in ("part", "status") and v is not None]
    return " ".join(shown) + f" [{row.status}]"


def environment(setup: Setup) -> dict:
    where = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    return {"device": where, "torch": torch.__version__, "dtype": str(setup.dtype).replace("torch.", ""),
            "backend": setup.backend.value, "dim": setup.dim, "heads": setup.heads, "group_size": GROUP,
            "samples": setup.samples, "warmup": setup.warmup}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    setup = Setup(device=torch.device(a.device), dtype=getattr(torch, a.dtype), backend=Kernel(a.backend), dim=a.dim,
                  heads=a.heads, samples=a.samples, warmup=a.warmup, seed=a.seed)
    grid = Grid(**{name: getattr(a, name) for name in Grid._fields})
    env = environment(setup)
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    parts: list[tuple[str, Iterator, Callable[[list], str]]]
    if a.aoti:
        parts = [("aoti", aoti_rows(grid, setup), aoti_table)]
    else:
        parts = []
        if a.part in ("all", "scoring"):
            parts.append(("scoring", scoring_rows(grid, setup), scoring_table))
        if a.part in ("all", "kernel"):
            parts.append(("kernel", kernel_rows(grid, setup), kernel_table))
    done: dict[str, list] = {name: [] for name, _, _ in parts}
    t_start = time.perf_counter()
    for name, rows, _ in parts:
        for row in rows:
            done[name].append(row)
            print(f"{name}: {progress(row)} ({time.perf_counter() - t_start:.0f} s)", flush=True)
            if a.json:
                with open(a.json, "w") as fh:
                    json.dump({"env": env, "rows": [asdict(r) for rs in done.values() for r in rs]}, fh, indent=1)
    for name, _, table in parts:
        print(f"\n{name}:\n\n{table(done[name])}")
    failed = [r for r in done.get("aoti", []) if r.passed is False]
    if failed:
        print(f"{len(failed)} AOTI row(s) differ from eager beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
