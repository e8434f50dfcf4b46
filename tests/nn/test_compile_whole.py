"""Models built on flexhstu's layers compile whole: ``torch.compile`` of an STU stack, the HSTU retrieval model
and the OneRank model, forward and backward, with and without ``fullgraph``, with a plan built inside or outside
the compiled region and with the relative bias, gives the eager results, and tracing finds no graph break."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from rules import offsets_from

from flexhstu import Kernel, build_plan, masks
from flexhstu.models.ranking import OneRankModel, RankingRequests, collate
from flexhstu.models.retrieval import HSTURetrieval, make_batch
from flexhstu.nn import STULayerConfig, STUStack

LENGTHS = [21, 0, 34, 9]
DIM = 32
interpreting = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton kernel on CPU"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _stack(rel_bias: bool, kernel: Kernel = Kernel.PYTORCH) -> STUStack:
    torch.manual_seed(0)
    cfg = STULayerConfig(
        embedding_dim=DIM,
        num_heads=2,
        attention_dim=8,
        hidden_dim=16,
        dropout=0.0,
        kernel=kernel,
        rel_bias=rel_bias,
        rel_bias_max_len=64,
    )
    return STUStack(cfg, 2)


def _mask(name: str, offs: torch.Tensor) -> dict:
    if name == "window":
        return {"max_attn_len": 8}
    if name == "targets":
        return {"num_targets": torch.tensor([3, 0, 5, 1])}
    if name == "sla":
        return {"attn_func": masks.sla(offs, 4, 2)}
    return {}


def _step(fn, params, x, *args, **kwargs):
    """Output and the gradients of (x, every parameter) for a loss that weights each output element."""
    x = x.detach().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return out, torch.autograd.grad((out * weights).sum(), [x, *params])


def _assert_close(got, want, rtol=1e-4):
    assert len(got[1]) == len(want[1])
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        scale = float(w.detach().abs().max()) if w.numel() else 0.0
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize(
    ("mask", "fullgraph", "plan", "rel_bias", "mode"),
    [
        ("causal", True, "outside", False, None),
        ("window", False, "inside", True, None),
        ("sla", True, "inside", True, None),
        ("targets", True, "outside", True, "reduce-overhead"),
    ],
)
def test_stu_stack_compiled_whole_gives_the_eager_output_and_gradients(mask, fullgraph, plan, rel_bias, mode):
    stack = _stack(rel_bias)
    offs = offsets_from(LENGTHS)
    kw = _mask(mask, offs)
    x = torch.randn(sum(LENGTHS), DIM, generator=torch.Generator().manual_seed(1))
    ts = torch.arange(sum(LENGTHS)) * 7
    if plan == "outside":
        kw["attn_plan"] = build_plan(offs, total=x.shape[0], max_seq_len=max(LENGTHS), **kw)
    compiled = torch.compile(stack, backend="inductor", fullgraph=fullgraph, mode=mode)
    want = _step(stack, list(stack.parameters()), x, offs, max(LENGTHS), ts, **kw)
    for _ in range(2):  # the second call runs the cached graph
        got = _step(compiled, list(stack.parameters()), x, offs, max(LENGTHS), ts, **kw)
        _assert_close(got, want)


def test_compiled_stack_still_refuses_a_plan_of_other_rows():
    stack = _stack(False)
    offs = offsets_from(LENGTHS)
    plan = build_plan(offsets_from([5, 5]), total=10, max_seq_len=5)
    x = torch.randn(sum(LENGTHS), DIM)
    with pytest.raises(ValueError, match="attn_plan: expected a plan"):
        torch.compile(stack, backend="eager")(x, offs, max(LENGTHS), attn_plan=plan)


def test_compiled_stack_refuses_a_plan_of_another_mask():
    stack = _stack(False)
    offs = offsets_from(LENGTHS)
    plan = build_plan(offs, total=sum(LENGTHS), max_seq_len=max(LENGTHS))  # causal
    x = torch.randn(sum(LENGTHS), DIM)
    with pytest.raises(ValueError, match="attn_plan: expected a plan for the call's mask"):
        torch.compile(stack, backend="eager")(x, offs, max(LENGTHS), attn_func=masks.causal(offs), attn_plan=plan)


def _retrieval(mask: str) -> tuple[HSTURetrieval, object]:
    torch.manual_seed(0)
    model = HSTURetrieval(30, dim=16, heads=2, layers=2, max_len=32, mask=mask, sla_k1=4, sla_k2=2, dropout=0.0)
    items = [np.arange(1, 12), np.arange(3, 9), np.arange(2, 20)]
    batch = make_batch(items, [np.arange(len(s)) * 5 for s in items], 32)
    return model, batch


def _requests() -> RankingRequests:
    return RankingRequests(
        hist_items=[np.array([1, 2, 3]), np.array([4])],
        hist_times=[np.array([10, 20, 30]), np.array([5])],
        cand_items=[np.array([5, 6]), np.array([7, 8, 9])],
        labels=[np.eye(2, 3, dtype=np.float32), np.ones((3, 3), dtype=np.float32)],
    )


def _loss_and_grads(model, fn):
    loss = fn()
    return loss, torch.autograd.grad(loss.float().sum(), [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("mask", ["causal", "sla"])
def test_retrieval_model_compiled_whole_gives_the_eager_loss_and_gradients(mask):
    model, batch = _retrieval(mask)
    neg = model.sample_negatives(8, torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    want = _loss_and_grads(model, lambda: model(batch, negatives=neg))
    got = _loss_and_grads(model, lambda: compiled(batch, negatives=neg))
    _assert_close(got, want)


def test_retrieval_loss_with_given_negatives_equals_the_sampled_loss():
    # The negatives drawn outside (what a compiled model does) are the ones the generator path draws.
    model, batch = _retrieval("causal")
    sampled = model(batch, 8, torch.Generator().manual_seed(5))
    given = model(batch, negatives=model.sample_negatives(8, torch.Generator().manual_seed(5)))
    assert torch.equal(sampled, given)


@pytest.mark.parametrize("task_tokens", [True, False])
def test_onerank_model_compiled_whole_gives_the_eager_scores_and_gradients(task_tokens):
    torch.manual_seed(0)
    model = OneRankModel(10, dim=8, layers=2, heads=2, max_len=8, task_tokens=task_tokens, dropout=0.0)
    inputs = collate(_requests(), [0, 1]).inputs()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    # Compiled, the output scale (1 / the longest sequence) stays on the device; eager reads it on the host.
    _assert_close(_loss_and_grads(model, lambda: compiled(*inputs)), _loss_and_grads(model, lambda: model(*inputs)))


def test_nothing_of_ours_breaks_the_graph():
    offs = offsets_from(LENGTHS)
    x = torch.randn(sum(LENGTHS), DIM)
    ts = torch.arange(sum(LENGTHS))
    cases = []
    for rel_bias in (False, True):
        stack = _stack(rel_bias)
        for mask in ("causal", "window", "targets", "sla"):
            cases.append((f"stack {mask} bias {rel_bias}", stack, (x, offs, max(LENGTHS), ts), _mask(mask, offs)))
        plan = build_plan(offs, total=x.shape[0], max_seq_len=max(LENGTHS))
        cases.append((f"stack plan bias {rel_bias}", stack, (x, offs, max(LENGTHS), ts), {"attn_plan": plan}))
    for mask in ("causal", "sla"):
        model, batch = _retrieval(mask)
        neg = model.sample_negatives(4, torch.Generator().manual_seed(0))
        cases.append((f"retrieval {mask}", model, (batch,), {"negatives": neg}))
    for task_tokens in (True, False):
        model = OneRankModel(10, dim=8, layers=2, heads=2, max_len=8, task_tokens=task_tokens, dropout=0.0)
        cases.append((f"onerank {task_tokens}", model, collate(_requests(), [0, 1]).inputs(), {}))
    breaks = {}
    for name, fn, args, kwargs in cases:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
        if explained.graph_break_count:
            breaks[name] = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert not breaks


@interpreting
def test_stu_stack_on_the_triton_kernels_compiled_whole_gives_the_eager_results():
    stack = _stack(True, Kernel.TRITON)
    offs = offsets_from(LENGTHS)
    x = torch.randn(sum(LENGTHS), DIM, generator=torch.Generator().manual_seed(1))
    ts = torch.arange(sum(LENGTHS)) * 7
    kw = {"max_attn_len": 8, "attn_plan": build_plan(offs, total=x.shape[0], max_seq_len=max(LENGTHS), max_attn_len=8)}
    want = _step(stack, list(stack.parameters()), x, offs, max(LENGTHS), ts, **kw)
    got = _step(
        torch.compile(stack, backend="inductor", fullgraph=True),
        list(stack.parameters()),
        x,
        offs,
        max(LENGTHS),
        ts,
        **kw,
    )
    _assert_close(got, want)
