"""Kept serving buffers (``GraphPool``): histories laid into a buffer with rows to spare score as a fresh gather,
whatever an earlier request left there, and the pool finds, keeps and drops its entries by what a graph reads."""

from __future__ import annotations

import pytest
import torch
from rules import offsets_from

from flexhstu import masks, serving
from flexhstu.models import OneRankModel
from flexhstu.serving import HistoryCache

LENGTHS = {"a": 5, "b": 0, "c": 13, "d": 3, "e": 9}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # score_micro_batch is what score_cached runs under no_grad
        yield


def cached(kernel="pytorch", dtype=torch.float64, layers=2):
    torch.manual_seed(0)
    model = OneRankModel(50, dim=16, layers=layers, heads=2, max_len=40, kernel=kernel).to(dtype).eval()
    users = list(LENGTHS)
    hist = torch.randint(1, 51, (sum(LENGTHS.values()),))
    times = torch.cumsum(torch.randint(0, 500, (hist.shape[0],)), 0)
    cache = HistoryCache(layers, 40)
    model.cache_histories(cache, users, hist, times, offsets_from(list(LENGTHS.values())))
    return model, cache


def test_onerank_rows_are_the_columns_of_the_whole_mask():
    lengths, targets, g = [9, 4, 0, 12], [4, 4, 0, 8], 4
    offs = offsets_from(lengths)
    whole = masks.onerank(offs, torch.tensor(targets), g)
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    i = torch.arange(sum(lengths)) - offs[seq]
    rows, width = masks.onerank_rows(i, torch.tensor(lengths)[seq], torch.tensor(targets)[seq], g)
    assert width == whole.shape[1] == 5
    torch.testing.assert_close(rows[None], whole, rtol=0, atol=0)
    pick = torch.tensor([3, 8, 21, 24])  # some rows alone: the same columns
    torch.testing.assert_close(
        masks.onerank_rows(i[pick], torch.tensor(lengths)[seq][pick], torch.tensor(targets)[seq][pick], g)[0],
        whole[0][:, pick],
        rtol=0,
        atol=0,
    )


def test_capacity_buckets_hold_what_is_asked_and_at_most_a_quarter_more():
    for rows in [0, 1, 1023, 1024, 1025, 1280, 1281, 5000, 16384 + 1024, 8 * (16384 + 1024), 10**7 + 3]:
        cap = serving.capacity_bucket(rows)
        assert cap >= rows and cap >= 1024
        assert cap <= max(1024, rows * 5 // 4), (rows, cap)
    assert serving.capacity_bucket(17000) == serving.capacity_bucket(20000) == 20480  # nearby sizes share one


def test_padded_widths_are_shared_by_the_requests_of_one_micro_batch_setting():
    g, fits = 4, [100, 3000]
    # Micro-batches of 256: every request where a user has over 224 candidates in a micro-batch gets one width.
    assert {serving.padded_width(w, 256, fits, g, 4096) for w in (256, 240, 225)} == {256}
    assert serving.padded_width(200, 256, fits, g, 4096) == 224 and serving.padded_width(3, 256, fits, g, 4096) == 16
    for widest in (0, 1, 17, 100, 1000, 4097):  # all candidates at once: a bucket, never below the need
        assert widest <= serving.padded_width(widest, None, [0], g, 10**6) <= max(16, widest * 5 // 4)
    # Where padding would take a history and its rows past max_seq_len: no padding, or no graph path at all.
    assert serving.padded_width(200, 256, [3000, 3100], g, 3100 + 4 * 200) == 200
    assert serving.padded_width(8, None, [30, 5], g, 40) is None  # user 0 (1 candidate, say) padded to 8


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
def test_histories_in_a_kept_buffer_score_as_a_fresh_gather_whatever_it_held(kernel, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, cache = cached(kernel, torch.float32 if kernel == "triton" else torch.float64)
    room = 3 * model.group_size
    kept = cache.gather(["c", "e", "a"], room=room)  # a buffer with rows to spare for the next request
    grown = serving.JaggedHistory(
        [torch.cat([k, torch.full_like(k[:50], float("nan"))]) for k in kept.k],
        [torch.cat([v, torch.full_like(v[:50], float("inf"))]) for v in kept.v],
        kept.offsets.clone(),
        kept.lengths,
        room,
    )
    items = torch.randint(1, 51, (6,))
    counts = torch.tensor([2, 3, 1])
    # NaN and Inf in the rows past the histories, and the second request's rows past its histories hold the
    # first's: none of it may reach a score.
    for users in (["c", "e", "a"], ["d", "b", "a"]):
        into = cache.gather(users, room=room, into=grown)
        assert into.k[0] is grown.k[0] and into.lengths == [LENGTHS[u] for u in users]
        fresh = cache.gather(users, room=room)
        got = model.score_micro_batch(into, items, counts, cache.max_seq_len)
        want = model.score_micro_batch(fresh, items, counts, cache.max_seq_len)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_kept_buffer_too_small_or_of_another_shape_is_refused_by_name():
    _, cache = cached()
    small = cache.gather(["a", "d"], room=4)
    with pytest.raises(ValueError, match=r"into: expected a history of 2 users with room 4 and at least 30 rows"):
        cache.gather(["c", "e"], room=4, into=small)
    with pytest.raises(ValueError, match=r"into: expected a history of 3 users"):
        cache.gather(["a", "d", "b"], room=4, into=small)


def eager_graphs(monkeypatch):
    """MicroBatchGraphs replays as eager calls (the CPU has no CUDA graphs; the GPU suite replays real ones)."""

    def call(self, items, counts, host_counts):
        return self.model.score_micro_batch(self.history, items, counts, self.max_seq_len)

    monkeypatch.setattr(serving.MicroBatchGraphs, "__call__", call)


def request(pool, model, cache, users, width):
    with pool.request(model, cache, users, width):
        pass
    return next(reversed(pool._entries.values()))


def test_the_pool_keeps_one_buffer_per_bucket_and_drops_the_least_recently_used():
    model, cache = cached()
    pool = serving.GraphPool(max_entries=2)
    first = request(pool, model, cache, ["c", "e"], 1)
    assert request(pool, model, cache, ["a", "d"], 1) is first  # other users, the same bucket: the same buffer
    assert first.graphs.history.k[0].shape[0] == 1024 and first.graphs.history.lengths == [5, 3]
    wider = request(pool, model, cache, ["a", "d"], 2)
    three = request(pool, model, cache, ["a", "d", "c"], 1)
    assert len(pool) == 2 and wider is not first and three is not first
    assert request(pool, model, cache, ["c", "e"], 1) is not first  # dropped: the least recently used
    with torch.inference_mode():  # inference tensors take no in-place update outside the mode: their own entry
        assert request(pool, model, cache, ["c", "e"], 1) is not first
    moved = request(pool, model.float(), cache, ["a", "d", "c"], 1)  # new parameter storage: never the old graphs
    assert moved is not three
    pool.clear()
    assert len(pool) == 0
    assert serving.graph_pool(model) is serving.graph_pool(model)
    with pytest.raises(ValueError, match=r"max_entries: expected"):
        serving.GraphPool(max_entries=0)


def test_a_models_own_pool_goes_with_the_model():
    import gc
    import weakref

    model, cache = cached()
    request(serving.graph_pool(model), model, cache, ["c", "e"], 1)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("micro_batch", [2, 3, None])
def test_padded_micro_batches_through_the_pool_score_as_the_eager_path(micro_batch, monkeypatch):
    # Several requests through one pool (its kept buffer, every user's candidates padded to one width), on the
    # CPU; the eager path equals the full recompute (test_serving.py).
    eager_graphs(monkeypatch)
    model, cache = cached()
    pool = serving.GraphPool()
    g = torch.Generator().manual_seed(3)
    for users, counts in ((["c", "a"], [4, 2]), (["d", "e"], [1, 5]), (["b", "c"], [3, 0]), (["c", "a"], [5, 5])):
        items = torch.randint(1, 51, (sum(counts),), generator=g)
        batches = serving.micro_batches(offsets_from(counts), micro_batch)
        widest = max(max(mb.counts) for mb in batches)
        width = serving.padded_width(widest, micro_batch, [LENGTHS[u] for u in users], model.group_size, 40)
        assert width >= widest and (micro_batch is None or width == min(micro_batch, 16) or width == widest)
        got = model._score_through_pool(pool, cache, users, items, batches, width)
        want = model.score_cached(cache, users, items, offsets_from(counts), micro_batch, cuda_graphs=False)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(pool) <= 2


def test_a_pool_run_refuses_counts_that_do_not_fit_its_items_or_width(monkeypatch):
    eager_graphs(monkeypatch)
    model, cache = cached()
    with serving.GraphPool().request(model, cache, ["c", "a"], 2) as run:
        items = torch.randint(1, 51, (3,))
        with pytest.raises(ValueError, match=r"host_counts: expected 2 counts of at most width=2 candidates"):
            run(items, torch.tensor([3, 0]), [3, 0])
        with pytest.raises(ValueError, match=r"host_counts: expected 2 counts"):
            run(items, torch.tensor([3]), [3])
        with pytest.raises(ValueError, match=r"items: expected the counts' 2 candidates, at least one, got 3"):
            run(items, torch.tensor([1, 1]), [1, 1])
        assert run(items, torch.tensor([2, 1]), [2, 1]).shape == (3, 3)
