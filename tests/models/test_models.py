"""Model construction and the OneRank collation: keyword configs, declared encoders, tensors in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexhstu import masks
from flexhstu.models import HSTURetrieval, OneRankModel, SASRecRetrieval, make_batch
from flexhstu.models.ranking import RankingRequests, collate
from flexhstu.nn import STULayerConfig


def test_stu_layer_config_refuses_positional_fields():
    with pytest.raises(TypeError):
        STULayerConfig(64, 2, 32, 16)


@pytest.mark.parametrize("cls", [HSTURetrieval, SASRecRetrieval, OneRankModel])
def test_heads_that_do_not_divide_dim_are_refused(cls):
    with pytest.raises(ValueError, match="heads: expected a divisor of dim=10, got 3"):
        cls(20, dim=10, heads=3)


def test_retrieval_models_receive_their_encoder_through_the_base_class():
    for model in (HSTURetrieval(20, dim=8, heads=2), SASRecRetrieval(20, dim=8, heads=2)):
        assert model.item_table().shape == (21, 8)


def _requests():
    return RankingRequests(
        hist_items=[np.array([1, 2, 3]), np.array([4])],
        hist_times=[np.array([10, 20, 30]), np.array([5])],
        cand_items=[np.array([5, 6]), np.array([7, 8, 9])],
        labels=[np.eye(2, 3, dtype=np.float32), np.ones((3, 3), dtype=np.float32)],
    )


def test_collate_returns_jagged_tensors_of_the_chosen_requests():
    b = collate(_requests(), [1, 0])
    assert b.hist_items.tolist() == [4, 1, 2, 3] and b.hist_times.tolist() == [5, 10, 20, 30]
    assert b.hist_offsets.tolist() == [0, 1, 4] and b.cand_offsets.tolist() == [0, 3, 5]
    assert b.cand_items.tolist() == [7, 8, 9, 5, 6]
    assert b.labels.shape == (5, 3) and b.labels[3].tolist() == [1, 0, 0]


@pytest.mark.parametrize("task_tokens", [True, False])
def test_onerank_forward_takes_tensors_and_scores_every_candidate(task_tokens):
    torch.manual_seed(0)
    model = OneRankModel(10, dim=8, layers=1, heads=2, max_len=8, task_tokens=task_tokens, dropout=0.0).eval()
    b = collate(_requests(), [0, 1])
    scores = model(*b.inputs())
    assert scores.shape == (5, 3) and torch.isfinite(scores).all()
    # requests do not see each other; the longest one sets the batch's max_seq_len (the output scale)
    longest, rows = (1, slice(2, 5)) if task_tokens else (0, slice(0, 2))
    torch.testing.assert_close(scores[rows], model(*collate(_requests(), [longest]).inputs()))
    assert model.group_size == (4 if task_tokens else 1)


def test_models_call_the_mask_builders_with_public_arguments_only(monkeypatch):
    def sla(seq_offsets, sla_k1, sla_k2, *, num_targets=None, contextual_seq_len=0, total=None, nfunc=None, nheads=1):
        return real_sla(seq_offsets, sla_k1, sla_k2, total=total)

    def onerank(seq_offsets, num_targets, group_size, *, total=None, nfunc=None, nheads=1):
        return real_onerank(seq_offsets, num_targets, group_size, total=total)

    real_sla, real_onerank = masks.sla, masks.onerank
    monkeypatch.setattr(masks, "sla", sla)
    monkeypatch.setattr(masks, "onerank", onerank)
    model = HSTURetrieval(10, dim=8, layers=1, heads=2, max_len=8, mask="sla", sla_k1=2, sla_k2=1)
    batch = make_batch([np.array([1, 2, 3, 4])], [np.array([1, 2, 3, 4])], 8)
    assert torch.isfinite(model(batch, 4, torch.Generator().manual_seed(0)))
    assert model.states(batch).shape == (3, 8)
    scores = OneRankModel(10, dim=8, layers=1, heads=2, max_len=8)(*collate(_requests(), [0]).inputs())
    assert scores.shape == (2, 3)
