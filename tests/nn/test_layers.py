"""STU layer across kernels; OneRank tokenizer layout, mask and gradients; head and loss."""

from __future__ import annotations

import os

import pytest
import torch
from rules import dense_from_rule, offsets_from, onerank_visible

from flexhstu import Kernel, masks
from flexhstu.nn import OneRankHead, OneRankTokenizer, STULayer, STULayerConfig, onerank_loss, time_gap_buckets


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton kernel on CPU"
)
def test_stu_layer_agrees_between_pytorch_and_triton_kernels():
    torch.manual_seed(0)
    lengths = [21, 0, 34]
    offs = offsets_from(lengths)
    cfg = STULayerConfig(
        embedding_dim=32, num_heads=2, attention_dim=16, hidden_dim=16, dropout=0.0, kernel=Kernel.PYTORCH
    )
    layer = STULayer(cfg)
    x = torch.randn(sum(lengths), 32, requires_grad=True)
    func = masks.sla(offs, 8, 2)
    ref = layer(x, offs, 34, attn_func=func)
    g_ref = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    layer.cfg.kernel = Kernel.TRITON
    out = layer(x, offs, 34, attn_func=func)
    g_out = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_tokenizer_layout_and_mask_equal_masks_onerank():
    dim, k = 8, 3
    tok = OneRankTokenizer(k, dim)
    hist_len, n_cand = [4, 0, 6], [2, 1, 0]
    hist = torch.randn(sum(hist_len), dim)
    cand = torch.randn(sum(n_cand), dim)
    b = tok(hist, offsets_from(hist_len), cand, offsets_from(n_cand))
    lengths = [h + n * (k + 1) for h, n in zip(hist_len, n_cand)]
    assert b.seq_offsets.tolist() == offsets_from(lengths).tolist()
    assert b.num_targets.tolist() == [n * (k + 1) for n in n_cand]
    # rows: history copied in order, each candidate followed by the K task embeddings
    assert torch.equal(b.x[0:4], hist[0:4]) and torch.equal(b.x[4], cand[0])
    assert torch.equal(b.x[5:8], tok.tasks.detach())
    assert torch.equal(b.x[8], cand[1]) and torch.equal(b.x[12], cand[2])
    assert torch.equal(b.x[b.candidate_rows], cand)
    assert b.task_rows.tolist() == [[5, 6, 7], [9, 10, 11], [13, 14, 15]]
    func = masks.onerank(b.seq_offsets, b.num_targets, tok.group_size)
    want = dense_from_rule(
        lengths, max(lengths), lambda s, i, j, L: onerank_visible(i, j, L, b.num_targets[s].item(), k + 1)
    )
    assert torch.equal(masks.to_dense(func, b.seq_offsets, max(lengths)), want)


def test_gradients_reach_candidates_and_task_embeddings():
    tok = OneRankTokenizer(2, 4)
    hist = torch.randn(3, 4, requires_grad=True)
    cand = torch.randn(2, 4, requires_grad=True)
    b = tok(hist, offsets_from([3]), cand, offsets_from([2]))
    (b.x[b.task_rows].sum() * 2 + b.x[b.candidate_rows].sum()).backward()
    assert torch.equal(cand.grad, torch.ones_like(cand))
    assert torch.equal(tok.tasks.grad, torch.full_like(tok.tasks, 4.0))  # two candidates, factor 2


def test_head_scores_and_loss_skip_lists_without_both_classes():
    head = OneRankHead(2, 4)
    z = torch.randn(5, 2, 4)
    s = head(z)
    torch.testing.assert_close(s, (z * head.readout).sum(-1) / 2.0 + head.bias)
    labels = torch.tensor([[1, 0], [0, 0], [1, 0], [0, 1], [1, 1]])
    cand_offsets = torch.tensor([0, 3, 5])
    loss = onerank_loss(s, labels, cand_offsets)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(s, labels.float())
    # request 0: task 0 has positives 0 and 2, negative 1; task 1 has no positive (skipped)
    # request 1: task 0 positive 4, negative 3; task 1 all positive (skipped)
    t0 = [torch.logaddexp(s[p, 0], s[1, 0]) - s[p, 0] for p in (0, 2)]
    nce = torch.stack([torch.stack(t0).mean(), torch.logaddexp(s[4, 0], s[3, 0]) - s[4, 0]]).mean()
    torch.testing.assert_close(loss, bce + nce)


def test_time_gap_buckets_are_log2_and_restart_per_sequence():
    ts = torch.tensor([100, 101, 105, 7, 1031])
    assert time_gap_buckets(ts, offsets_from([3, 2]), 32).tolist() == [0, 1, 2, 0, 10]
