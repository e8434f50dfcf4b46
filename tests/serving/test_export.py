"""export_scorer: one export serves any number of users, history rows and candidates; compile_scorer's input
errors. (The AOTInductor compile itself runs in tests/serving/test_bench_serving.py.)"""

from __future__ import annotations

import pytest
import torch
from rules import offsets_from

from flexhstu import serving
from flexhstu.models import OneRankModel
from flexhstu.serving import HistoryCache, ScorerInputs

HIST = [5, 0, 8, 3]


def cached_model():
    torch.manual_seed(0)
    model = OneRankModel(50, dim=16, layers=2, heads=2, max_len=40, kernel="pytorch").eval()
    g = torch.Generator().manual_seed(0)
    hist = torch.randint(1, 51, (sum(HIST),), generator=g)
    times = torch.cumsum(torch.randint(0, 500, (sum(HIST),), generator=g), 0)
    cache = HistoryCache(2, 32)
    model.cache_histories(cache, ["a", "b", "c", "d"], hist, times, offsets_from(HIST))
    return model, cache


def inputs(cache, users, counts):
    items = torch.arange(1, sum(counts) + 1)
    return ScorerInputs.of(cache.gather(users), items, torch.tensor(counts))


def test_one_dynamic_export_scores_requests_of_other_sizes_as_eager_does():
    model, cache = cached_model()
    scorer = serving.MicroBatchScorer(model, cache.max_seq_len)
    program = serving.export_scorer(scorer, inputs(cache, ["a", "b", "c", "d"], [3, 2, 5, 1]))
    for users, counts in ((["c"], [1]), (["d", "a"], [4, 2]), (["a", "b", "c", "d"], [1, 1, 1, 6])):
        request = inputs(cache, users, counts)
        torch.testing.assert_close(program.module()(*request), scorer(*request), rtol=0, atol=0)


def test_a_static_export_keeps_the_example_sizes():
    model, cache = cached_model()
    scorer = serving.MicroBatchScorer(model, cache.max_seq_len)
    program = serving.export_scorer(scorer, inputs(cache, ["c"], [1]), dynamic=False)  # 1s are fine when static
    request = inputs(cache, ["c"], [1])
    torch.testing.assert_close(program.module()(*request), scorer(*request), rtol=0, atol=0)
    with pytest.raises(AssertionError, match=r"Guard failed: ks\[0\].size\(\)\[0\] == 8"):
        program.module()(*inputs(cache, ["a", "c"], [1, 1]))


def test_a_dynamic_export_needs_an_example_of_at_least_two_of_each():
    model, cache = cached_model()
    scorer = serving.MicroBatchScorer(model, cache.max_seq_len)
    with pytest.raises(
        ValueError,
        match=r"example: expected at least 2 users, 2 history rows and 2 candidates for "
        r"dynamic shapes \(torch.export specialises sizes 0 and 1\), got 1 users, "
        r"8 history rows, 1 candidates",
    ):
        serving.export_scorer(scorer, inputs(cache, ["c"], [1]))
    with pytest.raises(TypeError, match=r"example: expected a ScorerInputs"):
        serving.export_scorer(scorer, tuple(inputs(cache, ["a", "c"], [2, 2])))


def test_compile_scorer_wants_a_pt2_package_path(tmp_path):
    model, cache = cached_model()
    scorer = serving.MicroBatchScorer(model, cache.max_seq_len)
    with pytest.raises(
        ValueError,
        match=r"package_path: expected a file name ending in .pt2 \(AOTInductor's "
        r"package\), got .*scorer.so",
    ):
        serving.compile_scorer(scorer, inputs(cache, ["a", "c"], [2, 2]), tmp_path / "scorer.so")


def test_the_exported_program_carries_no_offset_assertions():
    # AOTInductor runs the graph's kernels on generated inputs while it compiles for CUDA: the delta call's
    # device-side offset assertions fired there (H200), so export leaves them out (torch.compile keeps them).
    model, cache = cached_model()
    scorer = serving.MicroBatchScorer(model, cache.max_seq_len)
    program = serving.export_scorer(scorer, inputs(cache, ["a", "b", "c", "d"], [3, 2, 5, 1]))
    nodes = [
        n
        for module in program.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for n in module.graph.nodes
    ]  # the body sits in a submodule (no_grad)
    messages = [str(n.args[1]) for n in nodes if "_assert_async" in str(n.target) and len(n.args) > 1]
    assert any("max_seq_len" in m for m in messages), messages  # the walk sees assertions (the reference's)
    assert not [m for m in messages if "seq_offsets" in m or "q_start" in m or "q_offsets" in m], messages
