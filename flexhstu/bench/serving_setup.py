"""The serving benchmark's setting: what every part shares (device, dtype, model width, timing), the grid of
configurations, the random OneRank model and its users, and the helpers that time a call and turn an
out-of-memory error or a refused input into a row's status."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..jagged import offsets_from_lengths
from ..models import OneRankModel
from ..models.ranking import TASKS
from ..ops import Kernel
from . import timing
from .timing import Latency

GROUP = len(TASKS) + 1  # tokens per candidate: the candidate and its task tokens
ITEMS = 10_000  # catalogue size of the random model (the embedding table is not what is measured)


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


# ---------------------------------------------------------------------------------------------------------------
# Inputs: the model, the users' histories and candidates


def build_model(setup: Setup, *, layers: int, max_hist: int) -> OneRankModel:
    """A OneRank model with random weights, eval mode, on the setup's device and dtype; eager STU layers."""
    torch.manual_seed(setup.seed)
    model = OneRankModel(
        ITEMS, dim=setup.dim, layers=layers, heads=setup.heads, max_len=max_hist, dropout=0.0, kernel=setup.backend
    )
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
    return timing.latencies(call, setup.device, samples=setup.samples, warmup=setup.warmup)


def device_ms(call: Callable[[], object], setup: Setup) -> tuple[float, float]:
    """(device time, eager time) of ``call`` in ms: on CUDA the medians of ``triton.testing.do_bench`` over a
    CUDA-graph replay of the call and over the call itself; on the CPU both are wall time."""
    if setup.device.type != "cuda":
        _, lat = latencies(call, setup)
        return lat.median_ms, lat.median_ms
    import triton.testing

    replay = timing.captured(call)  # warm-up (compiles the kernels) off the capture stream, then the capture
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
