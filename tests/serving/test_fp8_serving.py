"""Cached scoring with e4m3 attention (``score_cached(fp8=True)``): close to the model's own scores, for every
micro-batch size, through the reference and the Triton kernel (interpreter), eagerly and through the graph pool."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_serving import ranking_request

from flexhstu import quantize_fp8, serving
from flexhstu.models import OneRankModel
from flexhstu.ops.fp8 import E4M3
from flexhstu.serving import HistoryCache


def model_and_cache(kernel, task_tokens=True):
    torch.manual_seed(0)
    model = OneRankModel(50, dim=32, layers=2, heads=2, max_len=40, task_tokens=task_tokens, kernel=kernel).eval()
    hist, times, hoffs, cands, coffs = ranking_request()
    cache = HistoryCache(num_layers=2, max_seq_len=32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, hoffs)
    return model, cache, cands, coffs


@pytest.mark.parametrize("kernel, task_tokens", [("pytorch", True), ("pytorch", False), ("triton", True)])
def test_fp8_scores_stay_close_to_the_models_scores_for_every_micro_batch_size(kernel, task_tokens):
    model, cache, cands, coffs = model_and_cache(kernel, task_tokens)
    users = ["a", "b", "c", "d"]
    want = model.score_cached(cache, users, cands, coffs)
    for micro_batch in (None, 1, 2):  # 2 leaves a user's last micro-batch short
        got = model.score_cached(cache, users, cands, coffs, micro_batch=micro_batch, fp8=True)
        assert got.dtype == want.dtype and got.shape == want.shape
        err = (got - want).abs().max().item()
        assert 0 < err < 0.05 * want.abs().max().item(), (micro_batch, err)


def test_quantize_history_keeps_the_layout_and_zero_room():
    _, cache, _, _ = model_and_cache("pytorch")
    history = cache.gather(["a", "b", "c", "d"], room=3)
    q = serving.quantize_history(history)
    assert q.fp8 and not history.fp8 and serving.quantize_history(q) is q
    assert q.offsets is history.offsets and q.lengths == history.lengths and q.room == 3
    for k8, ks, k in zip(q.k, q.k_scale, history.k):
        assert k8.dtype == E4M3 and ks.shape == k.shape[:2]
        assert torch.equal(k8.float() == 0, k == 0)  # the room's zero rows (and only exact zeros) stay zeros
        torch.testing.assert_close(k8.float() * ks[:, :, None], k, rtol=0.07, atol=0)


def reordered(cands, coffs, users, order):
    """The request's candidates for the users in ``order`` (each user's own candidates, in the new order)."""
    parts = [cands[coffs[users.index(u)] : coffs[users.index(u) + 1]] for u in order]
    return torch.cat(parts), torch.tensor([0, *itertools.accumulate(len(x) for x in parts)])


@pytest.mark.parametrize("micro_batch, kernel", [(2, "pytorch"), (None, "pytorch"), (2, "triton")])
def test_fp8_micro_batches_through_the_graph_pool_score_as_the_eager_path(micro_batch, kernel, monkeypatch):
    # The pool's e4m3 buffers (quantized from its staging buffer every request) give the eager e4m3 scores, for
    # several requests through one pool: the users in other orders (other history lengths in each slot, so rows
    # left from an earlier request would show), and a plain request between; an e4m3 entry and a plain one of the
    # same shape are kept apart.
    from test_graph_pool import eager_graphs

    eager_graphs(monkeypatch)
    model, cache, cands0, coffs0 = model_and_cache(kernel)
    pool = serving.GraphPool(max_entries=8)
    users0 = ["a", "b", "c", "d"]
    orders = [(users0, True), (["d", "c", "b", "a"], True), (users0, False), (["b", "d", "a", "c"], True)]
    for users, fp8 in orders:
        cands, coffs = reordered(cands0, coffs0, users0, users)
        batches = serving.micro_batches(coffs, micro_batch)
        widest = max(max(mb.counts) for mb in batches)
        width = serving.padded_width(widest, micro_batch, [cache.length(u) for u in users], model.group_size, 32)
        with torch.no_grad():  # as score_cached runs it
            got = model._score_through_pool(pool, cache, users, cands, batches, width, fp8)
        want = model.score_cached(cache, users, cands, coffs, micro_batch, cuda_graphs=False, fp8=fp8)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    fp8_entries = [e for e in pool._entries.values() if e.staging is not None]
    assert fp8_entries and all(e.graphs.history.fp8 for e in fp8_entries)
    assert len(fp8_entries) < len(pool)  # the plain request has an entry of its own


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_the_first_layers_e4m3_call_gets_the_quantized_keys_values_and_scales_of_the_whole_sequences(
    micro_batch, monkeypatch
):
    # Rows are quantized one by one, so history and new rows quantized apart must equal the whole sequences'
    # tensors (the history's room included) quantized at once: checked on the first delta call of each request.
    from flexhstu.serving import delta_stack

    model, cache, cands, coffs = model_and_cache("pytorch")
    calls = []
    real = delta_stack.delta_hstu_mha

    def spy(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)

    monkeypatch.setattr(delta_stack, "delta_hstu_mha", spy)
    for fp8 in (False, True):
        model.score_cached(cache, ["a", "b", "c", "d"], cands, coffs, micro_batch=micro_batch, fp8=fp8)
    plain = calls[0]
    e4m3 = next(c for c in calls if "fp8_scales" in c[1])
    (_, _, q, k, v), (_, _, q8, k8, v8) = plain[0][:5], e4m3[0][:5]
    qs, ks, vs = e4m3[1]["fp8_scales"]
    for x, x8, scale in ((q, q8, qs), (k, k8, ks), (v, v8, vs)):
        want8, want_scale = quantize_fp8(x)
        assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
        assert torch.equal(scale, want_scale)


def test_an_e4m3_history_with_bad_scales_is_refused_by_name():
    model, cache, _, _ = model_and_cache("pytorch")
    history = serving.quantize_history(cache.gather(["a", "b", "c", "d"], room=5))
    x = torch.zeros(4, 32)
    offsets = torch.tensor([0, 1, 2, 3, 4])
    cases = [
        (
            dict(v_scale=None),
            r"history.v_scale: expected one scale tensor per layer \(2, quantize_history\), got NoneType",
        ),
        (dict(k_scale=history.k_scale[:1]), r"history.k_scale: expected one scale tensor per layer \(2"),
        (
            dict(k_scale=[s.double() for s in history.k_scale]),
            r"history.k_scale\[0\]: expected \(\d+, 2\) torch.float32",
        ),
        (dict(v_scale=[s[:-1] for s in history.v_scale]), r"history.v_scale\[0\]: expected \(\d+, 2\) torch.float32"),
    ]
    for change, match in cases:
        bad = dataclasses.replace(history, **change)
        with pytest.raises(ValueError, match=match):
            serving.stack_delta(model.stack, x, bad, offsets, max_seq_len=32)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_graph_path_is_chosen_by_what_the_kernel_supports_in_the_attentions_dtype(fp8, monkeypatch):
    # Below compute capability 8.9 an e4m3 call falls back to the reference, which cannot be captured: the check
    # that picks (or refuses) CUDA graphs must ask about e4m3 inputs, not the model's dtype.
    import flexhstu.models.ranking as ranking

    seen = []
    monkeypatch.setattr(ranking, "triton_unsupported_reason", lambda q, v, *a, **k: seen.append((q.dtype, v.dtype)))
    model, _, _, _ = model_and_cache("triton")
    model._no_graph_reason(torch.device("cpu"), fp8)
    want = E4M3 if fp8 else model.head.bias.dtype
    assert seen == [(want, want)]
