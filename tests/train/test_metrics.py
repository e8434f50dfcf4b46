"""Retrieval and ranking metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexhstu import train
from flexhstu.metrics import (
    auc,
    gauc,
    hit_rate_and_ndcg,
    list_ndcg,
    mrr,
    ndcg_at,
    parse_metrics,
    ranks_to_metrics,
    target_rank,
)


def test_auc_is_the_share_of_correctly_ordered_pairs_with_ties_counting_half():
    assert auc(np.array([0.1, 0.9, 0.5, 0.3]), np.array([0, 1, 1, 0])) == 1.0
    assert auc(np.array([1.0, 1.0]), np.array([0, 1])) == 0.5
    # positives 0.4, 0.8 against negatives 0.5, 0.8: pairs (0.4 < 0.5) lost, (0.4 < 0.8) lost, (0.8 > 0.5) won,
    # (0.8 = 0.8) half
    assert auc(np.array([0.4, 0.5, 0.8, 0.8]), np.array([1, 0, 1, 0])) == pytest.approx(1.5 / 4)
    assert math.isnan(auc(np.array([0.1, 0.2]), np.array([1, 1])))


def test_ndcg_at_k_discounts_by_position_and_normalises_by_the_ideal_list():
    assert ndcg_at(np.array([0.9, 0.1, 0.5]), np.array([0, 1, 0])) == pytest.approx(1 / np.log2(4))
    # positives at ranks 0 and 2 of 3; ideal puts them at ranks 0 and 1
    want = (1 + 1 / np.log2(4)) / (1 + 1 / np.log2(3))
    assert ndcg_at(np.array([0.9, 0.5, 0.1]), np.array([1, 0, 1])) == pytest.approx(want)
    assert ndcg_at(np.array([0.9, 0.5, 0.1]), np.array([0, 0, 1]), k=2) == 0.0
    assert math.isnan(ndcg_at(np.array([0.3]), np.array([0])))


def test_list_ndcg_averages_lists_with_a_positive_only():
    scores = np.array([0.9, 0.1, 0.2, 0.8, 0.5])
    labels = np.array([0, 1, 0, 0, 1])
    # list [0, 2): positive at rank 1; list [2, 3): no positive (skipped); list [3, 5): positive at rank 1
    assert list_ndcg(scores, labels, np.array([0, 2, 3, 5])) == pytest.approx(1 / np.log2(3))
    assert math.isnan(list_ndcg(scores, np.zeros(5), np.array([0, 5])))


def test_target_rank_ignores_padding_and_seen_items_but_not_the_target():
    scores = torch.tensor([9.0, 1.0, 5.0, 3.0, 4.0])  # item 0 is padding
    assert target_rank(scores, 3, torch.tensor([], dtype=torch.int64)) == 2  # items 2 and 4 score higher
    assert target_rank(scores, 3, torch.tensor([2, 3])) == 1  # 2 is seen; the target itself is never removed
    assert target_rank(scores, 2, torch.tensor([4])) == 0


def test_a_non_finite_target_score_ranks_last():
    # A diverged model scores NaN everywhere: nothing compares greater than NaN, so counting the items above the
    # target ranked every target first (HR@10 = NDCG@10 = 1.0 for a run whose every loss was NaN).
    nan, inf = math.nan, math.inf
    none = torch.tensor([], dtype=torch.int64)
    assert target_rank(torch.full((6,), nan), 3, none) == 4  # 5 candidates (item 0 is padding): the last is 4
    assert target_rank(torch.full((6,), nan), 3, torch.tensor([1, 3])) == 3  # seen 1 is removed, the target kept
    assert target_rank(torch.tensor([0.0, 1.0, 2.0, inf, 0.5, 0.1]), 3, none) == 4
    assert target_rank(torch.tensor([0.0, 1.0, 2.0, -inf, 0.5, 0.1]), 3, none) == 4
    # an item whose score is NaN is not below the target
    assert target_rank(torch.tensor([0.0, nan, 2.0, 3.0, nan, 0.1]), 3, none) == 2


def test_ranking_metrics_of_non_finite_scores_are_nan():
    labels = np.array([1, 0, 1, 0])
    for scores in (np.full(4, np.nan), np.array([0.1, np.nan, 0.3, 0.2]), np.array([np.inf, 0.0, 1.0, 2.0])):
        assert math.isnan(auc(scores, labels)), scores
        assert math.isnan(gauc(scores, labels, np.array([0, 2, 4]))), scores
        assert math.isnan(ndcg_at(scores, labels)), scores
        assert math.isnan(list_ndcg(scores, labels, np.array([0, 2, 4]))), scores


def test_hit_rate_and_ndcg_count_ranks_below_k():
    got = hit_rate_and_ndcg([0, 3, 10, 12], k=10)
    assert got == {"HR@10": 0.5, "NDCG@10": pytest.approx((1 + 1 / math.log2(5)) / 4)}
    with pytest.raises(ValueError, match="ranks: expected at least one rank"):
        hit_rate_and_ndcg([])


def test_mrr_is_the_mean_reciprocal_of_the_one_based_rank():
    assert mrr([0, 1, 3]) == pytest.approx((1 + 1 / 2 + 1 / 4) / 3)
    with pytest.raises(ValueError, match="ranks: expected at least one rank"):
        mrr([])


def test_gauc_weights_each_groups_auc_by_its_impressions_and_skips_one_class_groups():
    scores = np.array([0.9, 0.1, 0.5, 0.2, 0.3, 0.7, 0.4, 0.6])
    labels = np.array([1, 0, 0, 1, 0, 1, 1, 1])
    # group [0, 2): AUC 1 (2 impressions); group [2, 6): positives 0.2, 0.7 vs negatives 0.5, 0.3 -> 2 of 4
    # pairs won, AUC 0.5 (4 impressions); group [6, 8): positives only, skipped
    assert gauc(scores, labels, np.array([0, 2, 6, 8])) == pytest.approx((2 * 1.0 + 4 * 0.5) / 6)
    assert math.isnan(gauc(scores[6:], labels[6:], np.array([0, 2])))


def test_ranks_give_hit_rate_ndcg_and_mrr_at_every_asked_cut_off():
    ranks = [0, 30, 120, 400]
    got = ranks_to_metrics(ranks, ["hr@10", "ndcg@50", "hr@200", "mrr"])
    assert got == {
        "HR@10": 0.25,
        "NDCG@50": pytest.approx((1 + 1 / math.log2(32)) / 4),
        "HR@200": 0.75,
        "MRR": pytest.approx((1 + 1 / 31 + 1 / 121 + 1 / 401) / 4),
    }


def test_metrics_names_keep_the_defaults_first_and_refuse_unknown_ones():
    assert parse_metrics("hr@50, NDCG@200,mrr,hr@10", "retrieval") == ["hr@10", "ndcg@10", "hr@50", "ndcg@200", "mrr"]
    assert parse_metrics(None, "ranking") == ["auc", "ndcg@10"]
    assert parse_metrics("gauc", "ranking") == ["auc", "ndcg@10", "gauc"]
    for bad, task in (
        ("hr@0", "retrieval"),
        ("recall@5", "retrieval"),
        ("gauc", "retrieval"),
        ("mrr", "ranking"),
        ("hr@x", "retrieval"),
    ):
        with pytest.raises(ValueError, match="--metrics: expected names from"):
            parse_metrics(bad, task)


def test_a_run_reports_the_asked_metrics_beside_the_default_keys(tmp_path):
    result = train.main(
        [
            "--model",
            "popularity",
            "--data",
            "synthetic",
            "--metrics",
            "hr@50,ndcg@100,mrr",
            "--out",
            str(tmp_path),
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    assert list(result["test"]) == ["HR@10", "NDCG@10", "HR@50", "NDCG@100", "MRR"]
    assert result["test"]["HR@10"] <= result["test"]["HR@50"]
