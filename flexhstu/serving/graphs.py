"""CUDA-graph replays of the candidate micro-batches of a request, kept across requests.

A micro-batch is about forty small kernels per STU layer (norms, projections, the
delta attention, index copies): launched from Python, a request of many
micro-batches waits on the host, not on the GPU (H200, 4 layers of 512, one user,
micro-batches of 256 of 2048 candidates: 53 ms of host time for 5.4 ms of device
time, ``benchmarks/profile_serving.py``). Micro-batches of one size run the same
kernels on the same buffers (the request's history, laid out once with room for
the new rows), so one captured graph serves them all: the first of a size runs
eagerly (it compiles and warms up what it needs), the second is captured, the rest
replay it with their candidates copied into the graph's inputs.

``GraphPool`` keeps the graphs from one request to the next: each request's
histories are copied into a kept buffer sized for a bucket of history rows, every
micro-batch is padded to one shape (candidates a user), and every captured kernel
reads the histories' lengths and the candidates' counts from the device, so
requests of other users, history lengths and counts replay the same graph. The
scores equal the eager path's to rounding: the kept buffer's size can change how
the delta kernel splits its key blocks (float32 partial sums, added in another
order).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .._errors import as_int, bad_value
from .cache import HistoryCache, JaggedHistory, quantize_history

GRAPH_MAX_ROWS = 8192
"""``score_cached`` replays graphs by default for micro-batches of at most this many new rows (candidates times
the group size, all users, after padding). The graphs are kept across requests (``GraphPool``), so a capture's
cost is paid once per micro-batch shape and buffer bucket. H100, 4 layers of 512, history 16384, 2048 candidates
a user (``benchmarks/RESULTS.md``): one user in micro-batches of 256 (1024 rows), 6.0-6.3 ms a request against
28-32 eager; the same user's candidates all at once (8192 rows), 3.8-3.9 ms against 5.2 eager (an older
eager path); eight users in micro-batches of 256 (8192 rows), level with eager (28.3 against 30.1 ms in one
run, 30.3 against 29.6 in another). Larger micro-batches are device-bound and were not measured."""


class MicroBatchGraphs:
    """``model.score_micro_batch`` against ``history`` (on CUDA, gathered with room), one graph per micro-batch
    size; call it as ``graphs(cand_items (c,), counts (B,), host_counts)`` (``counts``: int64 on the device, the
    same as ``host_counts``). Scores are the graph's output buffer: copy them before the next call of the same
    size. Within a request two micro-batches of one total size have the same per-user counts (``micro_batches``
    takes them in order), and the captured kernels read the counts from the device anyway.

    At most ``max_graphs`` sizes keep a graph (each holds its micro-batch's intermediate memory), the least
    recently replayed dropped first: a request's full micro-batches replay every time, while the sizes of its
    last, partial one vary from request to request."""

    def __init__(self, model: nn.Module, history: JaggedHistory, max_seq_len: int, max_graphs: int = 4):
        self.model, self.history, self.max_seq_len = model, history, max_seq_len
        self.max_graphs = as_int("max_graphs", max_graphs, minimum=1)
        self._seen: set[int] = set()
        self._graphs: OrderedDict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )

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
            self._graphs.move_to_end(size)
            graph, items, static_counts, out = self._graphs[size]
            items.copy_(cand_items)
            static_counts.copy_(counts)
            graph.replay()
            return out
        if size not in self._seen:  # eagerly: Triton compiles, cuBLAS picks its kernels, outside any capture
            out = self.model.score_micro_batch(self.history, cand_items, counts, self.max_seq_len)
            self._seen.add(size)  # after a run that succeeded (an out-of-memory error warms nothing up)
            return out
        while len(self._graphs) >= self.max_graphs:
            self._seen.discard(self._graphs.popitem(last=False)[0])  # run eagerly again before a new capture
        items, static_counts = cand_items.clone(), counts.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model.score_micro_batch(self.history, items, static_counts, self.max_seq_len)
        self._graphs[size] = (graph, items, static_counts, out)
        graph.replay()
        return out


def capacity_bucket(rows: int, least: int = 1024) -> int:
    """The kept buffer's rows for a request that needs ``rows``: the least of ``2^k``, ``1.25 2^k``, ``1.5 2^k``
    and ``1.75 2^k`` (at least ``least``, a power of two) not below it, so a buffer holds at most a quarter more
    than it needs and requests of nearby sizes share it (and its graphs)."""
    rows = as_int("rows", rows, minimum=0)
    power = as_int("least", least, minimum=4)
    while power * 2 <= rows:
        power *= 2
    return next(power * q // 4 for q in (4, 5, 6, 7, 8) if power * q // 4 >= rows)


def padded_width(
    widest: int, micro_batch: int | None, lengths: Sequence[int], group_size: int, max_seq_len: int
) -> int | None:
    """Candidates per user in every micro-batch of a request through a ``GraphPool`` (each user's are padded to
    it): the ``micro_batch`` size when some user reaches it, else ``capacity_bucket(widest, 16)``, so that the
    requests of one setting share one graph; ``widest`` where a history and that many padded rows would pass
    ``max_seq_len``, and None where even ``widest`` would (a user with a long history and few candidates: no
    graph path then). ``widest``: the most candidates of one user in one micro-batch."""
    fits = lambda w: all(n + group_size * w <= max_seq_len for n in lengths)
    width = capacity_bucket(widest, 16)
    if micro_batch is not None:
        width = min(width, micro_batch)
    width = max(width, widest)
    if fits(width):
        return width
    return widest if fits(widest) else None


class _Entry:
    """A kept history buffer, its graphs, and the event that marks the end of the last request that used them."""

    def __init__(self, graphs: MicroBatchGraphs, width: int, staging: JaggedHistory | None = None):
        self.graphs = graphs
        self.staging = staging  # with e4m3 graphs: the model-dtype buffer the histories are gathered into first
        device = graphs.history.offsets.device
        users = graphs.history.offsets.shape[0] - 1
        self.counts = torch.full((users,), width, dtype=torch.int64, device=device)  # every padded micro-batch
        self.done = torch.cuda.Event() if device.type == "cuda" else None
        self.used = False

    def settle(self) -> None:
        """Wait (on the host) until the device is done with the buffers: before they are freed."""
        if self.done is not None and self.used:
            self.done.synchronize()


class GraphPool:
    """Captured micro-batch graphs of a scoring model, kept across requests (``score_cached(..., cuda_graphs)``
    takes ``serving.graph_pool(model)`` unless given one).

    Every micro-batch of a request through the pool has the same shape: each user's candidates are padded to
    ``padded_width`` (copies of the micro-batch's first candidate, whose scores are dropped: candidate groups
    never see each other, so the real candidates' scores do not change), and one graph per shape is captured
    once and replayed by every later request of that shape, whatever its users and history lengths.

    One entry per (the model's parameter storage, inference mode, users per request, width, ``capacity_bucket``
    of the history rows with their room, the cache's ``max_seq_len``, the K and V shapes, e4m3 attention or not:
    ``request``'s ``fp8``): a history buffer of
    that many rows per layer, zeroed once, and its ``MicroBatchGraphs``. A request copies its users'
    histories into the buffer (``HistoryCache.gather(..., into=...)``) and replays. At most ``max_entries``
    entries are kept, the least recently used dropped first: each holds its buffers (rows x layers x the K and V
    of a row: 8 users of 16384 rows, 4 layers of 4 heads of 128, bf16: 1.25 GiB) and its graphs' memory;
    ``clear()`` drops them all (the memory returns to torch's caching allocator). New parameter tensors
    (``model.to(...)``) are never replayed against; weights loaded in place (``load_state_dict``) are read by
    the graphs. Requests through one pool take turns (``lock``), and a request's device work waits for the
    previous one's on its own stream (an event per entry), so requests may come from several threads and
    streams."""

    def __init__(self, max_entries: int = 2):
        self.max_entries = as_int("max_entries", max_entries, minimum=1)
        self.lock = threading.RLock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry, once the device is done with it."""
        with self.lock:
            while self._entries:
                self._entries.popitem(last=False)[1].settle()

    @contextmanager
    def request(
        self, model: nn.Module, cache: HistoryCache, users: Sequence[Hashable], width: int, fp8: bool = False
    ) -> Iterator[Callable[[torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]]:
        """Within the block, ``run(items (c,), counts (B,), host_counts)`` scores one micro-batch of the request:
        ``counts[b] <= width`` candidates of user ``b`` (int64 on the device, the same as ``host_counts``), user
        by user, at least one in all. The users' histories are laid out in the entry's buffer, each followed by
        room for ``width`` candidates; the pool is held until the block ends. A micro-batch short of ``width``
        for some user is padded on the device (no copy from the host, which would wait for the device). A full
        one returns the graph's output buffer itself: copy it before the next ``run``. With ``fp8`` the graphs
        run the attention in e4m3 (``score_cached``): the histories are gathered into a buffer of the model's dtype,
        then quantized into the graphs' e4m3 one (``quantize_history``), once per request."""
        g = model.group_size
        with self.lock:
            entry = self._entry(model, cache, users, width * g, fp8)
            graphs = entry.graphs
            device = graphs.history.offsets.device
            if entry.done is not None and entry.used:  # the last request's reads of the buffers come first
                torch.cuda.current_stream(device).wait_event(entry.done)
            if entry.staging is None:
                graphs.history = cache.gather(users, room=width * g, into=graphs.history)
            else:
                entry.staging = cache.gather(users, room=width * g, into=entry.staging)
                graphs.history = quantize_history(entry.staging, into=graphs.history)
            shape = [width] * len(users)

            def run(items: torch.Tensor, counts: torch.Tensor, host_counts: Sequence[int]) -> torch.Tensor:
                if len(host_counts) != len(shape) or max(host_counts, default=0) > width:
                    raise bad_value(
                        "host_counts", f"{len(shape)} counts of at most width={width} candidates", list(host_counts)
                    )
                if sum(host_counts) != items.shape[0] or not items.shape[0]:
                    raise bad_value("items", f"the counts' {sum(host_counts)} candidates, at least one", items.shape[0])
                if all(n == width for n in host_counts):
                    return graphs(items, entry.counts, shape)
                ends = counts.cumsum(0)
                t = torch.arange(items.shape[0], device=items.device)
                user = torch.searchsorted(ends, t, right=True)
                positions = user * width + t - (ends - counts)[user]  # the rows' places in the padded batch
                padded = items[:1].expand(len(shape) * width).clone()  # copies of the first, scores dropped
                padded[positions] = items
                return graphs(padded, entry.counts, shape)[positions]

            try:
                yield run
            finally:
                if entry.done is not None:
                    entry.done.record(torch.cuda.current_stream(device))
                    entry.used = True

    def _entry(
        self, model: nn.Module, cache: HistoryCache, users: Sequence[Hashable], room: int, fp8: bool = False
    ) -> _Entry:
        if not users:
            cache.gather(users)  # refuses by name
        lengths = [cache.length(u) for u in users]
        first = cache.entry(users[0])  # dims, dtype and device of the buffers
        capacity = capacity_bucket(sum(lengths) + room * len(users))
        key = (
            _storage(model),
            torch.is_inference_mode_enabled(),  # inference tensors take no in-place update outside the mode
            len(users),
            room,
            capacity,
            cache.max_seq_len,
            tuple((k.shape[1:], v.shape[1:], k.dtype, k.device) for k, v in zip(first.k, first.v)),
            fp8,
        )
        entry = self._entries.pop(key, None)
        if entry is None:
            while len(self._entries) >= self.max_entries:
                self._entries.popitem(last=False)[1].settle()
            kept = JaggedHistory(
                [k.new_zeros(capacity, *k.shape[1:]) for k in first.k],
                [v.new_zeros(capacity, *v.shape[1:]) for v in first.v],
                torch.zeros(len(users) + 1, dtype=torch.int64, device=first.k[0].device),
                [0] * len(users),
                room,
            )
            staging = None
            if fp8:  # the graphs read e4m3 buffers of the same rows (zeros, scale 1); kept stages the gather
                staging = kept
                kept = quantize_history(kept)
            entry = _Entry(MicroBatchGraphs(model, kept, cache.max_seq_len), room // model.group_size, staging)
        # A weak reference: the pool of serving.graph_pool(model) must not keep its model alive. Refreshed on
        # every request: a new model can take a dead one's storage, and with it its key.
        entry.graphs.model = weakref.proxy(model)
        self._entries[key] = entry
        return entry


def _storage(model: nn.Module) -> tuple:
    """Where and how the model's parameters and buffers are stored: a captured graph reads those addresses."""
    return tuple(
        (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        for t in itertools.chain(model.parameters(), model.buffers())
    )


_POOLS: weakref.WeakKeyDictionary[nn.Module, GraphPool] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def graph_pool(model: nn.Module) -> GraphPool:
    """The model's own ``GraphPool`` (made on first use; it goes with the model: its entries hold the model
    weakly)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(model)
        if pool is None:
            pool = _POOLS[model] = GraphPool()
        return pool
