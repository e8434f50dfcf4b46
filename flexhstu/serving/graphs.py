"""CUDA-graph replays of the candidate micro-batches of one request.

A micro-batch is about forty small kernels per STU layer (norms, projections, the
delta attention, index copies): launched from Python, a request of many
micro-batches waits on the host, not on the GPU (H200, 4 layers of 512, one user,
micro-batches of 256 of 2048 candidates: 53 ms of host time for 5.4 ms of device
time, ``benchmarks/profile_serving.py``). Micro-batches of one size run the same
kernels on the same buffers (the request's history, laid out once with room for
the new rows), so one captured graph serves them all: the first of a size runs
eagerly (it compiles and warms up what it needs), the second is captured, the rest
replay it with their candidates copied into the graph's inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._errors import bad_value
from .cache import JaggedHistory

GRAPH_MAX_ROWS = 4096
"""``score_cached`` replays graphs by default for micro-batches of at most this many new rows (candidates times
the group size, all users): below it a micro-batch is host-bound and the graph removes the host's time; above
it the device is the bound, and the capture's own host time is no longer hidden behind device work. H200, 4
layers of 512, history 16384, 2048 candidates in micro-batches of 256, a request with graphs against without:
one user (1024 rows) 14.3 ms against 28.6; eight users (8192 rows) 35.8 ms against 29.4
(``benchmarks/HISTORY.md``)."""


class MicroBatchGraphs:
    """``model.score_micro_batch`` against ``history`` (on CUDA, gathered with room), one graph per micro-batch
    size; call it as ``graphs(cand_items (c,), counts (B,), host_counts)`` (``counts``: int64 on the device, the
    same as ``host_counts``). Scores are the graph's output buffer: copy them before the next call of the same
    size. Within a request two micro-batches of one total size have the same per-user counts (``micro_batches``
    takes them in order), and the captured kernels read the counts from the device anyway."""

    def __init__(self, model: nn.Module, history: JaggedHistory, max_seq_len: int):
        self.model, self.history, self.max_seq_len = model, history, max_seq_len
        self._seen: set[int] = set()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, cand_items: torch.Tensor, counts: torch.Tensor, host_counts: Sequence[int]) -> torch.Tensor:
        """``host_counts``: ``counts`` as host ints, checked against the history's room here (a graph replay
        checks nothing: rows past a user's room would overwrite the next user's history)."""
        rows = self.model.group_size * max(host_counts, default=0)
        if rows > self.history.room:
            raise bad_value(
                "host_counts",
                f"at most {self.history.room // self.model.group_size} candidates per "
                f"user (the history's room of {self.history.room} rows, HistoryCache.gather)",
                list(host_counts),
            )
        size = cand_items.shape[0]
        if size in self._graphs:
            graph, items, static_counts, out = self._graphs[size]
            items.copy_(cand_items)
            static_counts.copy_(counts)
            graph.replay()
            return out
        if size not in self._seen:  # eagerly: Triton compiles, cuBLAS picks its kernels, outside any capture
            self._seen.add(size)
            return self.model.score_micro_batch(self.history, cand_items, counts, self.max_seq_len)
        items, static_counts = cand_items.clone(), counts.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model.score_micro_batch(self.history, items, static_counts, self.max_seq_len)
        self._graphs[size] = (graph, items, static_counts, out)
        graph.replay()
        return out
