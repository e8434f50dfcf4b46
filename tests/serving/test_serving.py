"""The history cache and cached scoring equal a full recompute of the whole sequences."""

from __future__ import annotations

import pytest
import torch
from launches import counted_launches
from rules import offsets_from

from flexhstu import DeltaPlan, masks, serving
from flexhstu.models import HSTURetrieval, OneRankModel, SeqBatch
from flexhstu.nn import STULayerConfig, STUStack
from flexhstu.serving import HistoryCache

HIST, CANDS = [5, 0, 8, 3], [3, 2, 5, 0]  # an empty history, a user with no candidates


def ranking_request(seed=0):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(1, 51, (sum(HIST),), generator=g)
    times = torch.cumsum(torch.randint(0, 500, (sum(HIST),), generator=g), 0)
    cands = torch.randint(1, 51, (sum(CANDS),), generator=g)
    return hist, times, offsets_from(HIST), cands, offsets_from(CANDS)


def cached_ranking_model(layers=1):
    """A float64 OneRank model (reference kernel) with the request's four histories cached (max_seq_len 32)."""
    model = OneRankModel(50, dim=16, layers=layers, heads=2, max_len=40, kernel="pytorch").double().eval()
    hist, times, hoffs, _, _ = ranking_request()
    cache = HistoryCache(layers, 32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    return model, cache


@pytest.mark.parametrize("task_tokens", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cached_scores_equal_full_recompute_for_every_micro_batch_size(task_tokens, dtype, tol):
    torch.manual_seed(0)
    model = OneRankModel(50, dim=16, layers=2, heads=2, max_len=40, task_tokens=task_tokens, kernel="pytorch")
    model = model.to(dtype).eval()
    hist, times, hoffs, cands, coffs = ranking_request()
    cache = HistoryCache(num_layers=2, max_seq_len=32)
    users = ["a", "b", "c", "d"]
    model.cache_histories(cache, users, hist, times, hoffs)
    with torch.no_grad():
        full = model(hist, times, hoffs, cands, coffs, max_seq_len=32)
    for micro_batch in (None, 1, 2, 4):  # 2 and 4 do not divide every user's count
        got = model.score_cached(cache, users, cands, coffs, micro_batch=micro_batch)
        torch.testing.assert_close(got, full, rtol=tol, atol=tol)


def test_cached_scores_follow_the_user_order_of_the_request():
    torch.manual_seed(1)
    model = OneRankModel(50, dim=16, layers=1, heads=2, max_len=40, kernel="pytorch").double().eval()
    hist, times, hoffs, cands, coffs = ranking_request(seed=2)
    cache = HistoryCache(1, 32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    # Request users c and a only: c's history is rows 5:13, a's rows 0:5.
    sub_c, sub_a = cands[5:10], cands[0:3]
    got = model.score_cached(cache, ["c", "a"], torch.cat([sub_c, sub_a]), offsets_from([5, 3]), micro_batch=2)
    with torch.no_grad():
        full = model(hist, times, hoffs, cands, coffs, max_seq_len=32)
    torch.testing.assert_close(got, torch.cat([full[5:10], full[0:3]]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", [None, "sla"])
def test_extend_equals_prefill_of_the_grown_history(mask):
    torch.manual_seed(0)
    stack = (
        STUStack(
            STULayerConfig(embedding_dim=12, num_heads=2, attention_dim=4, hidden_dim=5, dropout=0.0, kernel="pytorch"),
            2,
        )
        .double()
        .eval()
    )
    mask_fn = None if mask is None else (lambda o, t: {"attn_func": masks.sla(o, 2, 1, total=t)})
    before, after = [4, 0, 6], [3, 2, 0]
    x_before = torch.randn(sum(before), 12, dtype=torch.float64)
    x_new = torch.randn(sum(after), 12, dtype=torch.float64)
    grown = offsets_from([a + b for a, b in zip(before, after)])
    rows_new = torch.tensor([4, 5, 6, 7, 8])  # grown lengths [7, 2, 6]: a gets 4:7, b gets 7:9
    x_all = torch.empty(15, 12, dtype=torch.float64)
    old_rows = torch.tensor([0, 1, 2, 3, 9, 10, 11, 12, 13, 14])
    x_all[old_rows], x_all[rows_new] = x_before, x_new
    cache, whole = HistoryCache(2, 20), HistoryCache(2, 20)
    serving.prefill(stack, cache, ["a", "b", "c"], x_before, offsets_from(before), mask=mask_fn)
    out_new = serving.extend(stack, cache, ["a", "b", "c"], x_new, offsets_from(after), mask=mask_fn)
    out_all = serving.prefill(stack, whole, ["a", "b", "c"], x_all, grown, mask=mask_fn)
    with torch.no_grad():
        kw = {} if mask_fn is None else mask_fn(grown, 15)
        full = stack(x_all, grown, 20, **kw)
    torch.testing.assert_close(out_all, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_new, full[rows_new], rtol=1e-12, atol=1e-12)
    for user in ("a", "b", "c"):
        assert cache.length(user) == whole.length(user)
    got, want = cache.gather(["a", "b", "c"]), whole.gather(["a", "b", "c"])
    for layer in range(2):
        torch.testing.assert_close(got.k[layer], want.k[layer], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.v[layer], want.v[layer], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.stack(cache.last(["a", "b"])), full[[6, 8]], rtol=1e-12, atol=1e-12)


def test_retrieval_cached_scores_equal_the_full_scores_of_the_last_state():
    torch.manual_seed(0)
    model = (
        HSTURetrieval(
            30, dim=16, layers=2, heads=2, max_len=20, mask="sla", sla_k1=3, sla_k2=1, kernel="pytorch", rel_bias=False
        )
        .double()
        .eval()
    )
    lengths = [6, 3, 9]
    items = torch.randint(1, 31, (18,))
    batch = SeqBatch(items, torch.arange(18) * 60, torch.zeros(18, dtype=torch.int64), offsets_from(lengths), 24)
    cache = HistoryCache(2, 24)
    model.cache_histories(cache, [7, 8, 9], batch)
    cands = torch.tensor([3, 4, 5, 1, 2, 9, 9])
    got = model.score_cached(cache, [7, 8, 9], cands, offsets_from([3, 0, 4]))
    full = model.scores(batch)  # (B, items + 1), with the cache's max_seq_len as the batch's
    want = torch.cat([full[0, [3, 4, 5]], full[2, [1, 2, 9, 9]]])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    empty = SeqBatch(items[:0], items[:0], items[:0], offsets_from([0]), 24)
    model.cache_histories(cache, ["new"], empty)
    with pytest.raises(ValueError, match=r"users: expected users with a non-empty cached history"):
        model.score_cached(cache, ["new"], cands[:1], offsets_from([1]))


def test_micro_batches_cover_every_candidate_once_in_chunks_of_at_most_the_size():
    offs = offsets_from([5, 0, 2, 7])
    plans = serving.micro_batches(offs, 3)
    assert [p.counts for p in plans] == [[3, 0, 2, 3], [2, 0, 0, 3], [0, 0, 0, 1]]
    assert [p.counts_tensor.tolist() for p in plans] == [p.counts for p in plans]
    assert plans[1].index.tolist() == [3, 4, 10, 11, 12]  # user 0: candidates 3, 4; user 3 (rows 7..13): 3..5
    assert sorted(torch.cat([p.index for p in plans]).tolist()) == list(range(14))
    assert [p.counts for p in serving.micro_batches(offs, None)] == [[5, 0, 2, 7]]
    with pytest.raises(ValueError, match=r"micro_batch: expected an int >= 1, got 0"):
        serving.micro_batches(offs, 0)


def test_cache_errors_name_the_user_and_the_bound():
    torch.manual_seed(0)
    model = OneRankModel(50, dim=16, layers=1, heads=2, max_len=40, kernel="pytorch").eval()
    hist, times, hoffs, cands, _ = ranking_request()
    cache = HistoryCache(1, 6)
    with pytest.raises(
        ValueError,
        match=r"history of user 'c': expected at most the cache's max_seq_len=6 rows, "
        r"got 8 rows",
    ):
        model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    assert len(cache) == 0
    cache = HistoryCache(1, 32)
    with pytest.raises(ValueError, match=r"users: expected one user per sequence \(4\), got 3"):
        model.cache_histories(cache, ["a", "b", "c"], hist, times, hoffs)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    cache.evict("b")
    assert "b" not in cache and len(cache) == 3
    with pytest.raises(KeyError, match=r"user: expected a cached user .*got 'b'"):
        model.score_cached(cache, ["a", "b"], cands[:5], offsets_from([3, 2]))
    # A history and a micro-batch over the cache's bound are named as the caller knows them, not as a "max_seq_len"
    # it never gave. User "a" has 5 history rows; 6 candidates of group_size rows each do not fit the bound 16.
    small = HistoryCache(1, 16)
    model.cache_histories(small, ["a"], hist[:5], times[:5], offsets_from([5]))
    g = model.group_size
    with pytest.raises(
        ValueError,
        match=rf"micro_batch: expected at most {(16 - 5) // g} candidates of user 'a' at "
        rf"a time \(its history of 5 rows and {g} rows per candidate within the "
        rf"cache's max_seq_len 16\), got None \(6 at once\)",
    ):
        model.score_cached(small, ["a"], cands[:6], offsets_from([6]))
    with pytest.raises(
        ValueError,
        match=r"cand_items: expected item ids from 1 to num_items = 50 \(0: padding\), "
        r"got 51",
    ):
        model.score_cached(cache, ["a"], torch.tensor([3, 51]), offsets_from([2]))
    with pytest.raises(
        ValueError,
        match=r"item_ids: expected item ids from 1 to num_items = 50 \(0: padding\), "
        r"got -1",
    ):
        model.cache_histories(cache, ["e"], torch.tensor([4, -1]), times[:2], offsets_from([2]))
    with pytest.raises(
        TypeError,
        match=r"cand_items: expected an int64 or int32 tensor of item ids, "
        r"got torch.float32",
    ):
        model.score_cached(cache, ["a"], torch.tensor([3.0, 4.0]), offsets_from([2]))
    model.train()
    with pytest.raises(RuntimeError, match=r"OneRankModel: expected eval mode"):
        model.score_cached(cache, ["a"], cands[:3], offsets_from([3]))


def test_exported_micro_batch_scorer_gives_the_eager_and_full_recompute_scores():
    torch.manual_seed(0)
    model = OneRankModel(50, dim=16, layers=2, heads=2, max_len=40, kernel="pytorch").eval()
    hist, times, hoffs, cands, coffs = ranking_request()
    cache = HistoryCache(2, 32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    history = cache.gather(["a", "b", "c", "d"])
    args = (tuple(history.k), tuple(history.v), history.offsets, cands, torch.tensor(CANDS))
    scorer = serving.MicroBatchScorer(model, cache.max_seq_len)
    program = torch.export.export(scorer, args)
    with torch.no_grad():
        full = model(hist, times, hoffs, cands, coffs, max_seq_len=32)
    torch.testing.assert_close(program.module()(*args), scorer(*args), rtol=0, atol=0)
    torch.testing.assert_close(program.module()(*args), full, rtol=1e-5, atol=1e-5)


def test_cached_scores_through_the_triton_delta_kernel_equal_the_reference_full_recompute():
    torch.manual_seed(0)
    model = OneRankModel(50, dim=32, layers=2, heads=2, max_len=40, kernel="pytorch").eval()
    hist, times, hoffs, cands, coffs = ranking_request()
    with torch.no_grad():
        full = model(hist, times, hoffs, cands, coffs, max_seq_len=32)
    for layer in model.stack.layers:
        layer.cfg.kernel = "triton"  # the layers share one config
    cache = HistoryCache(2, 32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    got = model.score_cached(cache, ["a", "b", "c", "d"], cands, coffs, micro_batch=2)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("task_tokens", [True, False])  # an attn_func of the new rows, or num_targets
def test_a_micro_batch_makes_the_delta_tables_once_for_all_its_layers(monkeypatch, task_tokens):
    # Each layer's delta call made the safe offsets and the query block table again (3 launches before its kernel),
    # though every layer follows the same offsets: the layout's DeltaPlan lets the first make them for all four.
    torch.manual_seed(0)
    model = OneRankModel(50, dim=32, layers=4, heads=2, max_len=40, task_tokens=task_tokens, kernel="triton").eval()
    hist, times, hoffs, _, _ = ranking_request()
    cache = HistoryCache(4, 32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    history = cache.gather(["a", "b", "c", "d"], room=2 * model.group_size)
    batches = [
        (torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 2, 0])),
        (torch.tensor([5, 6, 7, 8]), torch.tensor([2, 0, 0, 2])),  # as many rows: other offsets alone
    ]

    def score(plans):
        monkeypatch.setattr(serving.delta_stack, "DeltaPlan", plans)
        with torch.no_grad(), counted_launches() as launches:
            scores = [model.score_micro_batch(history, items, counts, 32) for items, counts in batches]
        return scores, launches

    per_layer, before = score(lambda: None)  # no plan: every layer makes its own tables, as before
    shared, after = score(DeltaPlan)
    one = DeltaPlan()
    misused, rebuilt = score(lambda: one)  # one plan for both micro-batches: the second's offsets make their own
    tables, kernel = {"_safe_offsets_kernel": 2, "_block_table_kernel": 1}, {"delta_forward_kernel": 1}
    assert before == {name: 2 * 4 * n for name, n in (tables | kernel).items()}  # 16 launches a micro-batch
    assert after == rebuilt == {name: 2 * n for name, n in tables.items()} | {"delta_forward_kernel": 8}  # 7
    for want, got, again in zip(per_layer, shared, misused):
        assert torch.equal(got, want) and torch.equal(again, want)


def test_cached_serving_refuses_a_model_with_relative_attention_bias():
    # The delta path has no bias: running it would silently drop the bias the model was trained with.
    model = HSTURetrieval(30, dim=16, layers=2, heads=2, max_len=20, kernel="pytorch").double().eval()
    batch = SeqBatch(
        torch.randint(1, 31, (5,)), torch.arange(5) * 60, torch.zeros(5, dtype=torch.int64), offsets_from([5]), 24
    )
    with pytest.raises(
        ValueError,
        match=r"stack: expected STU layers without a relative attention bias .*"
        r"got rel_bias on layer 0",
    ):
        model.cache_histories(HistoryCache(2, 24), [1], batch)


def test_a_history_gathered_with_room_keeps_each_history_before_its_spare_rows_and_refuses_overflow():
    torch.manual_seed(0)
    model, cache = cached_ranking_model(layers=2)
    hoffs = ranking_request()[2]
    packed, roomy = cache.gather(["a", "b", "c", "d"]), cache.gather(["a", "b", "c", "d"], room=3)
    assert roomy.room == 3 and roomy.k[0].shape[0] == sum(HIST) + 4 * 3
    for b, (lo, n) in enumerate(zip(hoffs[:-1].tolist(), HIST)):
        torch.testing.assert_close(roomy.k[1][lo + 3 * b : lo + 3 * b + n], packed.k[1][lo : lo + n], rtol=0, atol=0)
    # 6 new rows per user, more than the room of 3: writing them would overwrite the next user's history.
    x = torch.randn(24, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"new rows of user 0: expected at most the history's room of 3 rows"):
        serving.stack_delta(model.stack, x, roomy, offsets_from([6, 6, 6, 6]), max_seq_len=32)


def test_cuda_graphs_for_candidates_on_the_cpu_are_refused_by_name():
    model, cache = cached_ranking_model()
    hist, times, hoffs, cands, coffs = ranking_request()
    with pytest.raises(ValueError, match=r"cuda_graphs: expected False or None for candidates on the CPU .*got True"):
        model.score_cached(cache, ["a", "b", "c", "d"], cands, coffs, micro_batch=1, cuda_graphs=True)
    auto = model.score_cached(cache, ["a", "b", "c", "d"], cands, coffs, micro_batch=1)  # None: eager on the CPU
    with torch.no_grad():
        torch.testing.assert_close(auto, model(hist, times, hoffs, cands, coffs, max_seq_len=32))


def test_graph_replays_check_the_room_and_models_without_triton_get_no_graphs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels run CPU tensors (the CI's setting)
    model, cache = cached_ranking_model()
    graphs = serving.MicroBatchGraphs(model, cache.gather(["a", "b"], room=2 * model.group_size), 32)
    # A replay checks nothing on the device: 3 candidates for a room of 2 would overwrite the next history.
    with pytest.raises(ValueError, match=r"host_counts: expected at most 2 candidates per user .*got \[3, 1\]"):
        graphs(torch.arange(1, 5), torch.tensor([3, 1]), [3, 1])
    # The reference kernel syncs (sizes read on the host): it cannot be captured.
    assert model._no_graph_reason(torch.device("cpu")) == "the STU layers use Kernel.PYTORCH"
    for layer in model.stack.layers:
        layer.cfg.kernel = "triton"  # the layers share one config
    assert "q.dtype: expected float16, bfloat16 or float32" in model._no_graph_reason(torch.device("cpu"))
    assert model.float()._no_graph_reason(torch.device("cpu")) is None  # CPU tensors run under the interpreter


def test_scorer_inputs_refuse_a_history_gathered_with_room():
    _, cache = cached_ranking_model()
    with pytest.raises(ValueError, match=r"history: expected a history gathered without room .*got room=4"):
        serving.ScorerInputs.of(cache.gather(["a"], room=4), torch.tensor([1]), torch.tensor([1]))


# Offsets that do not jag the rows they come with: unchecked, each aborts the process (heap corruption from
# repeat_interleave with an output size) or scores a candidate silently as 0.
BAD_OFFSETS = [
    ([0, 7, 5], r": expected non-decreasing offsets"),
    ([0, 2, 4], r"\[-1\]: expected the number of rows of the data"),
]


@pytest.mark.parametrize("offs,msg", BAD_OFFSETS)
def test_ranking_entry_points_refuse_offsets_that_do_not_jag_their_rows(offs, msg):
    model, cache = cached_ranking_model()
    hist, times, _, cands, _ = ranking_request()
    bad = torch.tensor(offs)
    with pytest.raises(ValueError, match="hist_offsets" + msg):
        model(hist[:5], times[:5], bad, cands[:5], torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match=msg):
        model.cache_histories(HistoryCache(1, 32), ["x", "y"], hist[:5], times[:5], bad)
    with pytest.raises(ValueError, match="cand_offsets" + msg):
        model.score_cached(cache, ["a", "b"], cands[:5], bad)
    with pytest.raises(ValueError, match=r"users: expected one user per candidate sequence \(2\), got 3"):
        model.score_cached(cache, ["a", "b", "c"], cands[:5], torch.tensor([0, 2, 5]))


@pytest.mark.parametrize("offs,msg", BAD_OFFSETS)
def test_retrieval_entry_points_refuse_offsets_that_do_not_jag_their_rows(offs, msg):
    torch.manual_seed(0)
    model = HSTURetrieval(30, dim=16, layers=1, heads=2, max_len=20, kernel="pytorch", rel_bias=False).eval()
    items = torch.randint(1, 31, (6,))
    batch = SeqBatch(items, torch.arange(6) * 60, torch.zeros(6, dtype=torch.int64), offsets_from([4, 2]), 24)
    cache = HistoryCache(1, 24)
    model.cache_histories(cache, [7, 8], batch)
    with pytest.raises(ValueError, match="cand_offsets" + msg):
        model.score_cached(cache, [7, 8], torch.tensor([3, 4, 5, 1, 2]), torch.tensor(offs))
    x = torch.randn(5, 16)
    with pytest.raises(ValueError, match="seq_offsets" + msg):
        serving.prefill(model.stack, HistoryCache(1, 24), ["p", "q"], x, torch.tensor(offs))


def test_a_refused_prefill_or_extend_leaves_the_cache_as_it_was():
    torch.manual_seed(0)
    model = HSTURetrieval(30, dim=16, layers=1, heads=2, max_len=20, kernel="pytorch", rel_bias=False).eval()
    cache = HistoryCache(1, 6)
    serving.prefill(model.stack, cache, ["a", "b"], torch.randn(7, 16), offsets_from([2, 5]))
    before = {u: cache.length(u) for u in ("a", "b")}
    with pytest.raises(
        ValueError,
        match=r"history of user 'b': expected at most the cache's max_seq_len=6 rows, "
        r"got 7 cached and new rows",
    ):
        serving.extend(model.stack, cache, ["a", "b"], torch.randn(4, 16), offsets_from([2, 2]))
    assert {u: cache.length(u) for u in ("a", "b")} == before  # "a" alone would have fitted: not appended either
    with pytest.raises(ValueError, match=r"history of user 'd': expected at most .*got 7 rows"):
        serving.prefill(model.stack, cache, ["c", "d"], torch.randn(9, 16), offsets_from([2, 7]))
    assert "c" not in cache and "d" not in cache
    with pytest.raises(
        ValueError,
        match=r"x: expected a \(total, 16\) tensor \(embedding_dim=16\), got shape "
        r"\(3, 8\)",
    ):
        serving.extend(model.stack, cache, ["a"], torch.randn(3, 8), offsets_from([3]))
    with pytest.raises(TypeError, match=r"x: expected torch.float32 .*got torch.float64"):
        serving.prefill(model.stack, cache, ["e"], torch.randn(3, 16, dtype=torch.float64), offsets_from([3]))
    assert {u: cache.length(u) for u in ("a", "b")} == before and len(cache) == 2


def test_cache_put_refuses_entries_that_would_fail_a_later_gather():
    from flexhstu.serving.cache import UserHistory

    cache = HistoryCache(2, 8)
    k, v, last = torch.zeros(3, 2, 4), torch.zeros(3, 2, 5), torch.zeros(16)
    cache.put("a", UserHistory([k, k], [v, v], last))
    bad = [
        (UserHistory([k], [v], last), ValueError, r"entry: expected K and V for 2 layers, got 1 and 1"),
        (UserHistory([k, k[:2]], [v, v], last), ValueError, r"entry.k\[1\]: expected 3 rows .*got 2"),
        (UserHistory([k, k], [v, v[:, :1]], last), ValueError, r"entry.v\[1\]: expected \(rows, 2, 5\) torch.float32"),
        (UserHistory([k, k.double()], [v, v], last), ValueError, r"entry.k\[1\]: expected \(rows, 2, 4\) torch.flo"),
        (
            UserHistory([k, k[0]], [v, v], last),
            ValueError,
            r"entry.k\[1\]: expected a \(rows, heads, dim\) tensor, "
            r"got shape \(2, 4\)",
        ),
        (UserHistory([k, k], [v, v], None), ValueError, r"entry.last: expected the stack's output"),
        (UserHistory([k, k], [v, v], last[None]), ValueError, r"entry.last: expected a \(D,\) tensor, got shape"),
        ((k, v), TypeError, r"entry: expected a flexhstu.serving.UserHistory, got tuple"),
    ]
    for entry, err, msg in bad:
        with pytest.raises(err, match=msg):
            cache.put("b", entry)
        with pytest.raises(err, match=msg):
            cache.append("a", entry)
    assert "b" not in cache and cache.length("a") == 3
    fresh = HistoryCache(1, 8)
    with pytest.raises(ValueError, match=r"entry.v\[0\]: expected 2 heads \(as entry.k\[0\]\), got 3"):
        fresh.put("a", UserHistory([k[:, :2]], [torch.zeros(3, 3, 5)], last))
    cache.append("a", UserHistory([k[:0], k[:0]], [v[:0], v[:0]], None))  # nothing new: allowed, last kept
    assert cache.length("a") == 3 and cache.last(["a"])[0] is last


def test_a_stack_that_does_not_fit_the_cache_is_refused_not_run_on_fewer_layers():
    # Review: extend with a 3-layer stack on a 2-layer cache ran 2 layers (zip stops at the shorter list).
    torch.manual_seed(0)
    cfg = dict(embedding_dim=16, num_heads=2, attention_dim=8, hidden_dim=8, kernel="pytorch")
    two, three = STUStack(STULayerConfig(**cfg), 2).eval(), STUStack(STULayerConfig(**cfg), 3).eval()
    cache = HistoryCache(2, 16)
    serving.prefill(two, cache, ["a"], torch.randn(4, 16), offsets_from([4]))
    with pytest.raises(ValueError, match=r"stack: expected 2 STU layers \(the cache's num_layers\), got 3"):
        serving.extend(three, cache, ["a"], torch.randn(2, 16), offsets_from([2]))
    four_heads = STUStack(STULayerConfig(**{**cfg, "num_heads": 4}), 2).eval()
    with pytest.raises(ValueError, match=r"history.k\[0\]: expected \(rows, 4, 8\) torch.float32 .*got \(4, 2, 8\)"):
        serving.extend(four_heads, cache, ["a"], torch.randn(2, 16), offsets_from([2]))
    with (
        pytest.raises(ValueError, match=r"torch.autocast: expected off for cached serving"),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        serving.extend(two, cache, ["a"], torch.randn(2, 16), offsets_from([2]))
    assert cache.length("a") == 4
    # The only cached user may be replaced by a cache of another dtype (a new model); with others it may not.
    serving.prefill(two.double(), cache, ["a"], torch.randn(3, 16, dtype=torch.float64), offsets_from([3]))
    assert cache.length("a") == 3
