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


def test_rooms_are_shared_by_the_requests_of_one_micro_batch_setting():
    g = 4
    # Micro-batches of 256: every request where a user has 256 candidates or more (or over 224) gets one room.
    assert {serving.room_bucket(w, 256, g) for w in (256, 240, 225)} == {g * 256}
    assert serving.room_bucket(200, 256, g) == g * 224 and serving.room_bucket(3, 256, g) == g * 16
    for widest in (0, 1, 17, 100, 1000, 4097):  # all candidates at once: a bucket, never below the need
        room = serving.room_bucket(widest, None, g)
        assert g * widest <= room <= g * max(16, widest * 5 // 4)
    assert serving.room_bucket(5, 2, g) == g * 5  # never below what the request needs


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
def test_histories_in_a_kept_buffer_score_as_a_fresh_gather_whatever_it_held(kernel, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, cache = cached(kernel, torch.float32 if kernel == "triton" else torch.float64)
    room = 3 * model.group_size
    kept = cache.gather(["c", "e", "a"], room=room)  # a buffer with rows to spare for the next request
    grown = serving.JaggedHistory(
        [torch.cat([k, torch.full_like(k[:50], 7.0)]) for k in kept.k],
        [torch.cat([v, torch.full_like(v[:50], -3.0)]) for v in kept.v],
        kept.offsets.clone(),
        kept.lengths,
        room,
    )
    items = torch.randint(1, 51, (6,))
    counts = torch.tensor([2, 3, 1])
    for users in (["c", "e", "a"], ["d", "b", "a"]):  # the second leaves the first's rows behind in the buffer
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


def test_the_pool_keeps_one_buffer_per_bucket_and_drops_the_least_recently_used():
    model, cache = cached()
    pool = serving.GraphPool(max_entries=2)
    first = pool.graphs(model, cache, ["c", "e"], 4)
    assert pool.graphs(model, cache, ["a", "d"], 4) is first  # other users, the same bucket: the same buffer
    assert first.history.k[0].shape[0] == 1024 and first.history.lengths == [5, 3]
    other_room = pool.graphs(model, cache, ["a", "d"], 8)
    three = pool.graphs(model, cache, ["a", "d", "c"], 4)
    assert len(pool) == 2 and other_room is not first and three is not first
    assert pool.graphs(model, cache, ["c", "e"], 4) is not first  # dropped: the least recently used
    moved = pool.graphs(model.float(), cache, ["a", "d", "c"], 4)  # new parameter storage: never the old graphs
    assert moved is not three
    pool.clear()
    assert len(pool) == 0
    assert serving.graph_pool(model) is serving.graph_pool(model)
    with pytest.raises(ValueError, match=r"max_entries: expected"):
        serving.GraphPool(max_entries=0)


def test_scores_through_a_pool_buffer_equal_the_full_recompute_over_requests():
    # The pool's eager runs (the first of each size) on the CPU: a kept buffer, several requests in turn.
    model, cache = cached()
    pool = serving.GraphPool()
    g = torch.Generator().manual_seed(3)
    for users, counts in ((["c", "a"], [4, 2]), (["d", "e"], [1, 5]), (["b", "c"], [3, 3])):
        items = torch.randint(1, 51, (sum(counts),), generator=g)
        room = model.group_size * 2
        graphs = pool.graphs(model, cache, users, room)
        got = torch.zeros(sum(counts), 3, dtype=torch.float64)
        for mb in serving.micro_batches(offsets_from(counts), 2):
            got[mb.index] = model.score_micro_batch(graphs.history, items[mb.index], mb.counts_tensor, 40)
        want = model.score_cached(cache, users, items, offsets_from(counts), micro_batch=2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(pool) == 1
