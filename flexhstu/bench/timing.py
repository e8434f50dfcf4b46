"""Timing helpers the benchmarks share: medians of ``do_bench``, CUDA-graph replays, request latencies, and the
number format of their tables."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class Timing:
    """Median over repeats (ms) and the spread of the repeats, ``(max - min) / median``."""

    ms: float = float("nan")
    spread: float = float("nan")


def median_of(fn: Callable[[], object], repeats: int, warmup: int, rep: int) -> Timing:
    """``repeats`` medians of ``triton.testing.do_bench(fn)`` (CUDA events; ``warmup`` and ``rep`` in ms): their
    median and spread."""
    import triton

    xs = [triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") for _ in range(repeats)]
    med = statistics.median(xs)
    return Timing(med, (max(xs) - min(xs)) / med)


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Latency(NamedTuple):
    median_ms: float
    p99_ms: float
    samples: int
    host_ms: float | None = None  # the median time until the call returned to the host (the device may be busy)


def latencies(call: Callable[[], object], device: torch.device, *, samples: int, warmup: int) -> tuple[object, Latency]:
    """``call``'s last output and its latency: ``warmup`` calls, then ``samples`` calls, each timed with CUDA
    events from an idle device (CPU: wall time). p99 is the nearest rank. ``host_ms``: the median wall time until
    the call returned (host work and the waits it made; where it is near ``median_ms`` the host is the bound)."""
    out = None
    for _ in range(warmup):
        out = call()
    times, host = [], []
    for _ in range(samples):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            t0 = time.perf_counter()
            out = call()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = call()
            times.append((time.perf_counter() - t0) * 1e3)
            host.append(times[-1])
    ordered = sorted(times)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return out, Latency(statistics.median(ordered), p99, len(ordered), statistics.median(host) if host else None)


def fmt(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec``; ``-`` for a value not measured (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
