"""The delta (serving) kernel and the STU layer's default fast path on CUDA, in bf16.

- every row of ``delta_hstu_mha`` (Triton) equals the matching row of the training forward
  (Triton, the whole sequences) within 2e-3 relative, under causal, SLA and OneRank masks, and both
  are within ``TOL`` of a float32 reference; with e4m3 inputs it equals the reference (the attention of the
  dequantized values);
- the STU stack's default path (lean body, compiled on CUDA) gives the eager plain layer's output and
  every parameter gradient within 1e-2 relative in bf16.

Run with the rest of the GPU suite: ``PYTHONPATH=$PWD python3 -m pytest tests/gpu -q -rA``.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_gpu import TOL, check, offsets, rel

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.nn import STULayerConfig, STUStack


def _delta_case(name, offs, lengths, delta):
    total = sum(lengths)
    nt = torch.tensor([delta] * len(lengths), device="cuda")
    if name == "causal":
        return masks.causal(offs, total=total)
    if name == "sla 256/32":
        return masks.sla(offs, 256, 32, total=total)
    return masks.onerank(offs, nt, 4, total=total)


@pytest.mark.parametrize("name", ["causal", "sla 256/32", "onerank"])
def test_delta_rows_equal_the_training_forward_rows(name):
    lengths, delta, heads, dim = [4096, 1500, 4096 + 256], 256, 4, 128
    offs = offsets(lengths)
    total, n, b = sum(lengths), max(lengths), len(lengths)
    func = _delta_case(name, offs, lengths, delta)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q_offs, q_start = flexhstu.last_rows_offsets(offs, delta)
    rows = (q_start[:, None] + offs[:-1, None] + torch.arange(delta, device="cuda")[None, :]).reshape(-1)
    full = flexhstu.hstu_mha(n, None, q, k, v, offs, attn_func=func, kernel=Kernel.TRITON)
    got = flexhstu.delta_hstu_mha(
        n,
        None,
        q[rows],
        k,
        v,
        offs,
        kernel=Kernel.TRITON,
        q_offsets=q_offs,
        q_start=q_start,
        attn_func=func[:, :, rows].contiguous(),
    )
    ref = flexhstu.hstu_mha(n, None, q.float(), k.float(), v.float(), offs, attn_func=func, kernel=Kernel.PYTORCH)
    check(f"delta {name} B{b} last {delta} rows", {"delta_vs_training": rel(got, full[rows])}, tol=2e-3)
    check(f"delta {name} vs float32 reference", {"out": rel(got, ref[rows])})


@pytest.mark.parametrize("name", ["causal", "sla 256/32", "onerank"])
def test_e4m3_delta_equals_the_reference(name):
    # The reference is the attention of the dequantized values: the kernel differs by its bfloat16 P V (as the
    # bfloat16 kernel's) and summation order. Against full precision the error is e4m3's own, reported too.
    lengths, delta, heads, dim = [4096, 1500, 4096 + 256], 256, 4, 128
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    func = _delta_case(name, offs, lengths, delta)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q_offs, q_start = flexhstu.last_rows_offsets(offs, delta)
    rows = (q_start[:, None] + offs[:-1, None] + torch.arange(delta, device="cuda")[None, :]).reshape(-1)
    (q8, qs), (k8, ks), (v8, vs) = (flexhstu.quantize_fp8(x) for x in (q[rows], k, v))
    kw = dict(q_offsets=q_offs, q_start=q_start, attn_func=func[:, :, rows].contiguous(), fp8_scales=(qs, ks, vs))
    got = flexhstu.delta_hstu_mha(n, None, q8, k8, v8, offs, kernel=Kernel.TRITON, **kw)
    want = flexhstu.delta_hstu_mha(n, None, q8, k8, v8, offs, kernel=Kernel.PYTORCH, **kw)
    full = flexhstu.hstu_mha(n, None, q.float(), k.float(), v.float(), offs, attn_func=func, kernel=Kernel.PYTORCH)
    assert got.dtype == torch.bfloat16
    check(f"delta e4m3 {name} vs the e4m3 reference", {"out": rel(got, want)})
    check(f"delta e4m3 {name} vs float32 (e4m3's own error)", {"out": rel(got, full[rows])}, tol=0.08)


@pytest.mark.parametrize("precision", ["bf16", "float32 under bf16 autocast"])
@pytest.mark.parametrize("mask", ["causal", "window 256"])
def test_stu_default_fast_path_equals_the_eager_layer_in_bf16(mask, precision):
    torch.manual_seed(0)
    lengths = [2048, 777, 0, 1500]
    offs = offsets(lengths)
    kw = {} if mask == "causal" else {"max_attn_len": 256}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg = dict(embedding_dim=256, num_heads=2, attention_dim=64, hidden_dim=64, dropout=0.0)
    eager = STUStack(STULayerConfig(**cfg, recompute=False, compile=False), 2).cuda().to(dtype)
    fast = STUStack(STULayerConfig(**cfg), 2).cuda().to(dtype)
    fast.load_state_dict(eager.state_dict())
    x = torch.randn(sum(lengths), 256, device="cuda", dtype=dtype)
    dout = torch.randn_like(x)
    results = []
    for stack in (eager, fast):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "bf16"):
            out = stack(xi, offs, max(lengths), **kw)
        grads = torch.autograd.grad(out, [xi, *stack.parameters()], dout)
        assert all(g.dtype == dtype for g in grads)
        results.append((out, grads))
    (o_e, g_e), (o_f, g_f) = results
    errs = {"out": rel(o_f, o_e), "dx": rel(g_f[0], g_e[0])}
    errs["worst_param_grad"] = max(rel(a, b) for a, b in zip(g_f[1:], g_e[1:]))
    check(f"STU default vs eager, 2 layers, {mask}, {precision}", errs, tol=TOL)


class _Step(torch.nn.Module):
    """One batch's STU step with its mask and plan fixed: what torch.cuda.make_graphed_callables captures."""

    def __init__(self, stack, offs, n, kw, plan):
        super().__init__()
        self.stack, self.offs, self.n, self.kw, self.plan = stack, offs, n, kw, plan

    def forward(self, x):
        return self.stack(x, self.offs, self.n, attn_plan=self.plan, **self.kw)


@pytest.mark.parametrize("mask", ["causal", "sla 256/32"])
def test_stu_stack_captured_in_a_cuda_graph_equals_eager(mask):
    # The README's recipe: a plan built once, the step captured with make_graphed_callables, replayed.
    torch.manual_seed(0)
    lengths = [2048, 777, 0, 1500]
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    kw = {} if mask == "causal" else {"attn_func": masks.sla(offs, 256, 32, total=total)}
    cfg = STULayerConfig(embedding_dim=256, num_heads=2, attention_dim=64, hidden_dim=64, dropout=0.0)
    stack = STUStack(cfg, 2).cuda().to(torch.bfloat16)
    plan = flexhstu.build_plan(offs, total=total, max_seq_len=n, sparse=mask != "causal", **kw)
    step = _Step(stack, offs, n, kw, plan)
    x = torch.randn(total, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(total, 256, device="cuda", dtype=torch.bfloat16)
    # Captured first: an eager autograd graph alive during the capture holds the parameters' gradient
    # accumulators, made on the default stream, which the captured backward may not wait on.
    graphed = torch.cuda.make_graphed_callables(step, (x.detach().clone().requires_grad_(True),))
    out_e = step(x)
    grads_e = torch.autograd.grad(out_e, [x, *stack.parameters()], dout)
    xg = x.detach().clone().requires_grad_(True)
    out_g = graphed(xg)
    grads_g = torch.autograd.grad(out_g, [xg, *stack.parameters()], dout)
    errs = {
        "out": rel(out_g, out_e),
        "dx": rel(grads_g[0], grads_e[0]),
        "worst_param_grad": max(rel(a, b) for a, b in zip(grads_g[1:], grads_e[1:])),
    }
    check(f"STU stack in a CUDA graph vs eager, {mask}", errs, tol=1e-3)


@pytest.mark.parametrize("fp8", [False, True])
def test_cached_scoring_with_cuda_graphs_equals_eager_micro_batches(fp8):
    # 300 candidates a user in micro-batches of 64: 64 (eager), 64 (captured), 64, 64 (replays), 44 (eager). With
    # fp8 the attention runs in e4m3, the graphs on the pool's e4m3 buffers.
    from flexhstu.models import OneRankModel
    from flexhstu.serving import HistoryCache

    torch.manual_seed(0)
    model = OneRankModel(1000, dim=128, layers=2, heads=2, max_len=2048, dropout=0.0, kernel="triton")
    model = model.to("cuda", torch.bfloat16).eval()
    hist_lengths, cands = [1000, 17, 640], 300
    hoffs = offsets(hist_lengths)
    hist = torch.randint(1, 1001, (sum(hist_lengths),), device="cuda")
    times = torch.arange(sum(hist_lengths), device="cuda") * 60
    items = torch.randint(1, 1001, (3 * cands,), device="cuda")
    coffs = offsets([cands] * 3)
    cache = HistoryCache(2, max_seq_len=1000 + 4 * cands)
    users = ["a", "b", "c"]
    model.cache_histories(cache, users, hist, times, hoffs)
    eager = model.score_cached(cache, users, items, coffs, micro_batch=64, cuda_graphs=False, fp8=fp8)
    graphed = model.score_cached(cache, users, items, coffs, micro_batch=64, cuda_graphs=True, fp8=fp8)
    again = model.score_cached(cache, users, items, coffs, micro_batch=64, fp8=fp8)  # graphs (5 of <= 768 rows)
    with torch.no_grad():
        full = model(hist, times, hoffs, items, coffs, max_seq_len=1000 + 4 * cands)
    check(
        f"cached scoring, CUDA graphs{', e4m3' if fp8 else ''}",
        {"graphs_vs_eager": rel(graphed, eager), "auto_vs_eager": rel(again, eager)},
        tol=1e-3,
    )
    check(
        f"cached scoring{', e4m3,' if fp8 else ''} vs full recompute",
        {"scores": rel(eager, full)},
        tol=8e-2 if fp8 else 3e-2,
    )


def test_graphs_kept_across_requests_replay_for_other_users_and_history_lengths():
    # One pool, requests of other users, history lengths and per-user counts in one buffer bucket: the padded
    # micro-batch shape is captured once and replayed since; each request equals its eager micro-batches.
    from flexhstu import serving
    from flexhstu.models import OneRankModel
    from flexhstu.serving import HistoryCache

    torch.manual_seed(0)
    model = OneRankModel(1000, dim=128, layers=2, heads=2, max_len=2048, dropout=0.0, kernel="triton")
    model = model.to("cuda", torch.bfloat16).eval()
    # Each pair's histories and room (2 x 4 x 32 rows) within (1280, 1536]: the 1536-row bucket.
    lengths = {"a": 1000, "b": 200, "c": 640, "d": 600, "e": 0, "f": 1150}
    hist = torch.randint(1, 1001, (sum(lengths.values()),), device="cuda")
    times = torch.arange(hist.shape[0], device="cuda") * 60
    cache = HistoryCache(2, max_seq_len=1300 + 4 * 96)
    model.cache_histories(cache, list(lengths), hist, times, offsets(list(lengths.values())))
    pool = serving.GraphPool()
    errs = {}
    requests = [(["a", "b"], [96, 96]), (["c", "d"], [96, 96]), (["e", "f"], [96, 96]), (["a", "b"], [96, 96])]
    # Other per-user counts ([32, 32], then [32, 16] and [16, 32], [1, 7], [0, 31], ...): the micro-batches short
    # of 32 candidates for some user are padded to 32 a user, one shape for all.
    requests += [(["c", "d"], [80, 48]), (["b", "a"], [48, 80]), (["f", "e"], [33, 7]), (["d", "c"], [1, 95])]
    for users, counts in requests:
        items = torch.randint(1, 1001, (sum(counts),), device="cuda")
        coffs = offsets(counts)
        eager = model.score_cached(cache, users, items, coffs, micro_batch=32, cuda_graphs=False)
        graphed = model.score_cached(cache, users, items, coffs, micro_batch=32, cuda_graphs=True, graph_pool=pool)
        errs["".join(users) + str(counts)] = rel(graphed, eager)
    # Two requests on two streams, back to back: the second's copies into the kept buffer wait for the first.
    side = [torch.cuda.Stream(), torch.cuda.Stream()]
    pairs = [
        (["a", "b"], torch.randint(1, 1001, (192,), device="cuda")),
        (["c", "d"], torch.randint(1, 1001, (192,), device="cuda")),
    ]
    torch.cuda.synchronize()
    outs = []
    for stream, (users, items) in zip(side, pairs):
        with torch.cuda.stream(stream):
            outs.append(model.score_cached(cache, users, items, offsets([96, 96]), micro_batch=32, graph_pool=pool))
    torch.cuda.synchronize()
    for (users, items), got in zip(pairs, outs):
        eager = model.score_cached(cache, users, items, offsets([96, 96]), micro_batch=32, cuda_graphs=False)
        errs["streams " + "".join(users)] = rel(got, eager)
    assert len(pool) == 1  # every request in the one bucket's buffer
    entry = next(iter(pool._entries.values()))
    assert list(entry.graphs._graphs) == [64]  # 2 x 32 candidates: captured once (in the first request)
    check("kept graphs across requests vs eager", errs, tol=1e-3)


@pytest.mark.parametrize(
    ("mask", "mode", "rel_bias", "plan"),
    [
        ("causal", None, False, "outside"),
        ("window 256", "reduce-overhead", False, "inside"),
        ("sla 256/32", None, True, "outside"),
    ],
)
def test_stu_stack_compiled_whole_equals_eager_on_the_triton_kernels(mask, mode, rel_bias, plan):
    # torch.compile(model) of the whole stack, fullgraph, as users compile a model: the attention is the
    # Triton custom op inside the graph, the plan built by the caller or by the stack.
    torch.manual_seed(0)
    lengths = [2048, 777, 0, 1500]
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    kw = {
        "window 256": {"max_attn_len": 256},
        "causal": {},
        "sla 256/32": {"attn_func": masks.sla(offs, 256, 32, total=total)},
    }[mask]
    cfg = STULayerConfig(
        embedding_dim=256,
        num_heads=2,
        attention_dim=64,
        hidden_dim=64,
        dropout=0.0,
        rel_bias=rel_bias,
        rel_bias_max_len=n,
    )
    stack = STUStack(cfg, 2).cuda().to(torch.bfloat16)
    if plan == "outside":
        kw["attn_plan"] = flexhstu.build_plan(offs, total=total, max_seq_len=n, **kw)
    ts = torch.arange(total, device="cuda") * 60
    x = torch.randn(total, 256, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    compiled = torch.compile(stack, fullgraph=True, mode=mode)
    results = []
    for fn in (stack, compiled, compiled, compiled):  # eager, then the compiled step three times (replays)
        torch.compiler.cudagraph_mark_step_begin()
        xi = x.clone().requires_grad_(True)
        out = fn(xi, offs, n, ts, **kw)
        grads = torch.autograd.grad(out, [xi, *stack.parameters()], dout)
        results.append((out.clone(), [g.clone() for g in grads]))  # a later replay may reuse graph outputs
    (o_e, g_e), (o_c, g_c) = results[0], results[-1]
    errs = {
        "out": rel(o_c, o_e),
        "dx": rel(g_c[0], g_e[0]),
        "worst_param_grad": max(rel(a, b) for a, b in zip(g_c[1:], g_e[1:])),
    }
    check(f"STU stack compiled whole vs eager, {mask}, mode {mode}, bias {rel_bias}", errs, tol=TOL)
