"""Block plans built once (flexhstu.ops.plan.build_plan) and reused: same results as plan-free calls,
forward and backward, for every mask mode; a plan used with another call's offsets, size or mask is
refused. Triton kernels under TRITON_INTERPRET=1 on the CPU (or on a GPU when one is present)."""

from __future__ import annotations

import os

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.nn import STULayerConfig, STUStack
from flexhstu.ops.plan import build_plan
from flexhstu.ops.triton import triton_hstu_mha
from flexhstu.ops.triton.debug import poison_outputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a GPU",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
LENGTHS = [37, 0, 70, 5]
HEADS = 2


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    with poison_outputs():
        yield


def plan_kwargs(name, offs, lengths):
    """build_plan's mask arguments for one mask mode."""
    n, t = max(lengths), sum(lengths)
    g = torch.Generator().manual_seed(5)
    nt = torch.tensor([min(5, L) for L in lengths], device=DEVICE)
    return {
        "causal": {},
        "non-causal": dict(causal=False),
        "fixed": dict(num_targets=nt, max_attn_len=10, contextual_seq_len=3),
        "sla": dict(attn_func=masks.sla(offs, 20, 4)),
        "sla-widened-5": dict(attn_func=masks.widen(masks.sla(offs, 20, 4), 5)),
        "onerank": dict(
            attn_func=masks.onerank(offs, torch.tensor([(L // 3) // 4 * 4 for L in lengths], device=DEVICE), 4)
        ),
        "random-per-head-5": dict(
            attn_func=torch.randint(-3, n + 3, (HEADS, 5, t), generator=g, dtype=torch.int32).to(DEVICE)
        ),
        "random-9": dict(attn_func=torch.randint(-3, n + 3, (1, 9, t), generator=g, dtype=torch.int32).to(DEVICE)),
    }[name]


def mask_args(plan):
    """triton_hstu_mha's mask arguments that match the plan (what hstu_mha passes for the same mask)."""
    vis = plan.block.vis
    return dict(
        func=vis.func,
        num_targets=vis.num_targets,
        causal_closed_form=vis.mode == 1,
        contextual=vis.contextual,
        window=vis.window,
        min_full=vis.min_full,
    )


def tensors(total, seed, dqk=16, dv=32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, HEADS, d, generator=g).to(DEVICE).requires_grad_(True) for d in (dqk, dqk, dv)]


def two_layers(q, k, v, offs, margs, plan, n):
    """Two attention calls in a row, the second fed from the first's output (one plan for both)."""
    common = dict(alpha=0.3, out_scale=1 / 50, max_seq_len=n, plan=plan, **margs)
    h1 = triton_hstu_mha(q, k, v, offs, **common)
    return triton_hstu_mha(h1[..., : q.shape[2]] + q, k, h1 + v, offs, **common)


@pytest.mark.parametrize(
    "name", ["causal", "non-causal", "fixed", "sla", "sla-widened-5", "onerank", "random-per-head-5", "random-9"]
)
def test_a_plan_reused_across_two_layers_gives_the_plan_free_results(name):
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    plan = build_plan(offs, total=total, max_seq_len=n, **plan_kwargs(name, offs, LENGTHS))
    margs = mask_args(plan)
    q, k, v = tensors(total, seed=1)
    out = two_layers(q, k, v, offs, margs, plan, n)
    ref = two_layers(q, k, v, offs, margs, None, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")


def test_a_plan_serves_two_head_dims():
    # Tiles follow the head dims, so the key-major plan is built per tile and cached in the plan.
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    plan = build_plan(offs, total=total, max_seq_len=n, attn_func=masks.sla(offs, 20, 4))
    for dqk, dv in ((16, 32), (64, 128)):
        q, k, v = tensors(total, seed=dqk, dqk=dqk, dv=dv)
        common = dict(alpha=0.3, out_scale=0.1, max_seq_len=n, **mask_args(plan))
        out = triton_hstu_mha(q, k, v, offs, plan=plan, **common)
        ref = triton_hstu_mha(q, k, v, offs, **common)
        torch.testing.assert_close(out, ref)
        for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
            torch.testing.assert_close(g, w)


def _call(plan, offs, total, **margs):
    q, k, v = tensors(total, seed=0)
    return triton_hstu_mha(q, k, v, offs, alpha=0.3, out_scale=0.1, max_seq_len=70, plan=plan, **margs)


def test_a_plan_of_other_offsets_is_refused():
    offs = offsets_from(LENGTHS).to(DEVICE)
    plan = build_plan(offs, total=sum(LENGTHS), max_seq_len=70)
    other = offsets_from(LENGTHS).to(DEVICE)  # equal values, another batch's tensor
    with pytest.raises(ValueError, match="attn_plan: expected a plan built from this call's seq_offsets"):
        _call(plan, other, sum(LENGTHS), causal_closed_form=True)


def test_a_plan_of_another_total_is_refused():
    offs = offsets_from(LENGTHS).to(DEVICE)
    plan = build_plan(offs, total=sum(LENGTHS) + 1, max_seq_len=70)
    with pytest.raises(ValueError, match=f"attn_plan: expected a plan for the call's {sum(LENGTHS)} rows"):
        _call(plan, offs, sum(LENGTHS), causal_closed_form=True)


@pytest.mark.parametrize("changed", ["seq_offsets", "attn_func", "num_targets"])
def test_a_plan_whose_tensors_changed_in_place_is_refused(changed):
    # The plan's block tables hold the old values: using it would be a silent wrong answer (audit finding).
    offs = offsets_from(LENGTHS).to(DEVICE)
    total = sum(LENGTHS)
    func = masks.sla(offs, 20, 4)
    nt = torch.tensor([3, 0, 5, 1], device=DEVICE)
    margs = {
        "seq_offsets": dict(causal_closed_form=True),
        "attn_func": dict(func=func),
        "num_targets": dict(num_targets=nt),
    }[changed]
    plan_args = {"seq_offsets": {}, "attn_func": dict(attn_func=func), "num_targets": dict(num_targets=nt)}[changed]
    plan = build_plan(offs, total=total, max_seq_len=70, **plan_args)
    _call(plan, offs, total, **margs)  # accepted before the change
    {"seq_offsets": offs, "attn_func": func, "num_targets": nt}[changed].add_(0)  # same values, a new version
    with pytest.raises(ValueError, match="attn_plan: expected a plan built after the last in-place change"):
        _call(plan, offs, total, **margs)


@pytest.mark.parametrize("call_mask", ["other-func", "causal", "fixed-window"])
def test_a_plan_of_another_mask_is_refused(call_mask):
    offs = offsets_from(LENGTHS).to(DEVICE)
    func = masks.sla(offs, 20, 4)
    plan = build_plan(offs, total=sum(LENGTHS), max_seq_len=70, attn_func=func)
    margs = {
        "other-func": dict(func=func.clone()),
        "causal": dict(causal_closed_form=True),
        "fixed-window": dict(window=8),
    }[call_mask]
    with pytest.raises(ValueError, match="attn_plan: expected a plan for the call's mask"):
        _call(plan, offs, sum(LENGTHS), **margs)


def test_build_plan_refuses_fixed_rule_arguments_beside_a_func():
    offs = offsets_from(LENGTHS).to(DEVICE)
    with pytest.raises(ValueError, match="max_attn_len: expected its default"):
        build_plan(offs, total=sum(LENGTHS), max_seq_len=70, attn_func=masks.sla(offs, 20, 4), max_attn_len=4)


def test_build_plan_names_attn_func_in_a_dtype_error():
    # Audit: a float func was refused as "func: expected dtype torch.int32", an argument build_plan does not have.
    offs = offsets_from(LENGTHS).to(DEVICE)
    with pytest.raises(TypeError, match=r"^attn_func: expected dtype torch.int32, got torch.float32$"):
        build_plan(offs, total=sum(LENGTHS), max_seq_len=70, attn_func=masks.causal(offs).float())


def test_build_plan_refuses_a_func_of_another_total():
    offs = offsets_from(LENGTHS).to(DEVICE)
    func = masks.causal(offsets_from([*LENGTHS, 3]).to(DEVICE))
    with pytest.raises(ValueError, match="attn_func: expected"):
        build_plan(offs, total=sum(LENGTHS), max_seq_len=70, attn_func=func)


@pytest.mark.parametrize("name", ["sla", "fixed", "onerank"])
def test_hstu_mha_with_a_sparse_plan_equals_the_plan_free_call(name):
    # sparse=True switches the kernels to the other tile family (other block shapes in the interpreter too).
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    kw = plan_kwargs(name, offs, LENGTHS)
    plan = build_plan(offs, total=total, max_seq_len=n, sparse=True, **kw)
    q, k, v = tensors(total, seed=3)
    out = flexhstu.hstu_mha(n, 0.3, q, k, v, offs, attn_plan=plan, kernel=Kernel.TRITON, **kw)
    ref = flexhstu.hstu_mha(n, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_every_backend_refuses_a_plan_of_another_mask():
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    plan = build_plan(offs, total=total, max_seq_len=n, max_attn_len=8)
    q, k, v = tensors(total, seed=0)
    for kernel in (Kernel.PYTORCH, Kernel.TRITON):
        with pytest.raises(ValueError, match="attn_plan: expected a plan for the call's mask"):
            flexhstu.hstu_mha(n, 0.3, q, k, v, offs, max_attn_len=9, attn_plan=plan, kernel=kernel)


def test_attn_plan_must_be_a_plan():
    offs = offsets_from(LENGTHS).to(DEVICE)
    q, k, v = tensors(sum(LENGTHS), seed=0)
    with pytest.raises(TypeError, match="attn_plan: expected None or an AttnPlan"):
        flexhstu.hstu_mha(70, 0.3, q, k, v, offs, attn_plan="plan")


def test_the_stu_stack_builds_one_plan_per_batch(monkeypatch):
    built = []
    real = flexhstu.nn.stu.build_plan

    def counting(*args, **kwargs):
        built.append(kwargs.get("sparse"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flexhstu.nn.stu, "build_plan", counting)
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    cfg = STULayerConfig(
        embedding_dim=16, num_heads=2, attention_dim=16, hidden_dim=16, dropout=0.0, kernel=Kernel.TRITON, compile=False
    )
    stack = STUStack(cfg, 3).to(DEVICE)
    x = torch.randn(total, 16, device=DEVICE, requires_grad=True)
    func = masks.sla(offs, 20, 4)
    out = stack(x, offs, n, attn_func=func, sparse=True)
    out.sum().backward()
    assert built == [True]
    cfg_ref = STULayerConfig(
        embedding_dim=16,
        num_heads=2,
        attention_dim=16,
        hidden_dim=16,
        dropout=0.0,
        kernel=Kernel.PYTORCH,
        compile=False,
    )
    ref_stack = STUStack(cfg_ref, 3).to(DEVICE)
    ref_stack.load_state_dict(stack.state_dict())
    torch.testing.assert_close(out, ref_stack(x, offs, n, attn_func=func), rtol=1e-4, atol=1e-5)


def test_building_a_plan_imports_no_triton():
    import subprocess
    import sys

    code = (
        "import sys, torch, flexhstu; o = torch.tensor([0, 3, 5]); "
        "flexhstu.build_plan(o, total=5, max_seq_len=3, attn_func=flexhstu.masks.sla(o, 2, 1)); "
        "print('triton' in sys.modules)"
    )
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["causal", "sla", "random-per-head-5"])
@pytest.mark.parametrize("chunk, max_split", [(2, 4), (1, 16), (3, 2)])
def test_the_split_list_cuts_every_long_key_block_range_into_its_pieces(name, chunk, max_split):
    # The dK/dV kernel walks piece 0 of each key block's query range in the key block's program and the listed
    # pieces in workers: together they must cover [q_lo, q_hi) once, with at most max_split pieces, the last
    # running to q_hi (ranges longer than chunk * max_split included).
    from flexhstu.ops.triton.block_plan import BlockPlan, Visibility
    from flexhstu.ops.triton.config import Tile
    from flexhstu.ops.triton.row_intervals import MODE_CAUSAL, MODE_FUNC

    lengths = [200, 0, 37, 70, 5]
    offs = offsets_from(lengths).to(DEVICE)
    total = sum(lengths)
    func = None if name == "causal" else plan_kwargs(name, offs, lengths)["attn_func"]
    vis = Visibility(MODE_CAUSAL if func is None else MODE_FUNC, func)
    tile = Tile(16, 8, 4, 1)
    km = BlockPlan(offs, total, vis).key_major(tile)
    split = km.split_list(chunk, max_split)
    nplan = km.qlo.shape[0] if func is not None else 1
    ktab = km.ktab.cpu()
    for hp in range(nplan):
        items = {}
        for i in range(int(split.n[hp])):
            items.setdefault(int(split.kb[hp, i]), []).append((int(split.lo[hp, i]), int(split.hi[hp, i])))
        for kf in range(km.n_kblocks):
            seq = int(ktab[kf])
            kb = kf - (int(offs[seq]) // tile.block_n + seq)
            L = lengths[seq]
            if kb * tile.block_n >= L:
                assert kf not in items
                continue
            if func is None:
                q_lo, q_hi = kb * tile.block_n // tile.block_m, -(-L // tile.block_m)
            else:
                q_lo, q_hi = int(km.qlo[hp, kf]), int(km.qhi[hp, kf])
            span = q_hi - q_lo
            if span <= chunk:
                assert kf not in items, (kf, span)
                continue
            pieces = [(q_lo, q_lo + chunk)] + items[kf]
            assert len(pieces) == min(-(-span // chunk), max_split)
            assert [p[0] for p in pieces] == [q_lo + chunk * j for j in range(len(pieces))]
            assert [p[1] for p in pieces[:-1]] == [p[0] for p in pieces[1:]] and pieces[-1][1] == q_hi
    assert any(int(n) > 0 for n in split.n), "no key block was split: the test covers nothing"


def test_a_plans_kept_launch_arguments_follow_each_calls_alpha_dtype_head_dims_and_max_seq_len():
    # The kernels' arguments that depend on the plan are made once and kept in it (Visibility.cached_args),
    # keyed by what else they depend on: a call that changes one of those must not run on another call's.
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    kw = plan_kwargs("sla", offs, LENGTHS)
    plan = build_plan(offs, total=total, max_seq_len=n, **kw)
    calls = [  # alpha (the score floor), dtype (dot precision), head dims, max_seq_len (the dK/dV split)
        dict(alpha=0.3, dtype=torch.float32, dqk=16, dv=32, max_seq_len=n),
        dict(alpha=2.0, dtype=torch.float32, dqk=16, dv=32, max_seq_len=n),
        dict(alpha=0.3, dtype=torch.float16, dqk=16, dv=32, max_seq_len=n),
        dict(alpha=0.3, dtype=torch.float32, dqk=32, dv=16, max_seq_len=n),
        dict(alpha=0.3, dtype=torch.float32, dqk=32, dv=16, max_seq_len=4 * n),
        dict(alpha=0.3, dtype=torch.float32, dqk=16, dv=32, max_seq_len=n),
    ]
    for i, c in enumerate(calls):
        q, k, v = (x.to(c["dtype"]).detach().requires_grad_() for x in tensors(total, seed=i, dqk=c["dqk"], dv=c["dv"]))
        args = (c["max_seq_len"], c["alpha"], q, k, v, offs)
        out = flexhstu.hstu_mha(*args, attn_plan=plan, kernel=Kernel.TRITON, scaling_seqlen=n, **kw)
        ref = flexhstu.hstu_mha(*args, kernel=Kernel.PYTORCH, scaling_seqlen=n, **kw)
        tol = dict(rtol=2e-2, atol=2e-2) if c["dtype"] == torch.float16 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out, ref, **tol, msg=lambda m, c=c: f"{c}: {m}")
        dout = torch.randn_like(out)
        for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(g, w, **tol, msg=lambda m, c=c: f"{c}: {m}")


def test_a_plans_kept_launch_arguments_follow_each_calls_heads_and_attn_scale():
    # The launches' kept arguments (Visibility.cached_args) are keyed by the heads too (the dK/dV grid) and by
    # whether attn_scale is given (HAS_ATTN_SCALE): calls on one plan that alternate them must each run on theirs.
    offs = offsets_from(LENGTHS).to(DEVICE)
    total, n = sum(LENGTHS), max(LENGTHS)
    kw = plan_kwargs("sla", offs, LENGTHS)
    plan = build_plan(offs, total=total, max_seq_len=n, **kw)
    g = torch.Generator().manual_seed(3)
    scale = (torch.rand(total, generator=g) + 0.5).to(DEVICE)
    for heads, attn_scale in ((2, None), (2, scale), (1, scale), (1, None), (2, None), (2, scale)):
        q, k, v = (torch.randn(total, heads, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
        extra = dict(scaling_seqlen=n) if attn_scale is None else dict(attn_scale=attn_scale)
        args = (n, 0.3, q, k, v, offs)
        out = flexhstu.hstu_mha(*args, attn_plan=plan, kernel=Kernel.TRITON, **extra, **kw)
        ref = flexhstu.hstu_mha(*args, kernel=Kernel.PYTORCH, **extra, **kw)
        what = f"heads {heads}, attn_scale {attn_scale is not None}"
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m, w=what: f"{w}: {m}")
        dout = torch.randn_like(out)
        for g_, w_ in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-5, msg=lambda m, w=what: f"{w}: {m}")


def test_the_kept_attention_arguments_follow_alpha_and_the_bias():
    # FLOOR_SCORES (silu.finite_below) is on for |alpha| > 1 or a bias: a kept argument set of another call
    # would give NaN for -inf scores (the equality test above cannot make one).
    from flexhstu.ops.triton.launch import _attention_args

    offs = offsets_from(LENGTHS).to(DEVICE)
    plan = build_plan(offs, total=sum(LENGTHS), max_seq_len=max(LENGTHS), attn_func=masks.sla(offs, 20, 4))
    block = plan.block
    q, k, v = tensors(sum(LENGTHS), seed=0)
    floors = [
        _attention_args(q, k, v, block.offs, block.vis, alpha, True, biased)["FLOOR_SCORES"]
        for alpha, biased in ((0.3, False), (2.0, False), (0.3, True), (-1.5, False), (0.3, False))
    ]
    assert floors == [False, True, True, True, False]


@pytest.mark.parametrize("tile", [(16, 32), (32, 64), (64, 64), (128, 64)])
def test_the_window_bound_on_query_blocks_per_key_block_holds_and_is_tight(tile):
    # Under a window alone the dK/dV launch is not split when this bound is at most its chunk (launch.
    # window_query_blocks): it must hold for every key block, and be no bound for the other fixed rules.
    from flexhstu.masks.rules import dense_fixed
    from flexhstu.ops.triton.config import Tile
    from flexhstu.ops.triton.launch import _NEVER_SPLIT, visibility, window_query_blocks

    bm, bn = tile
    lengths = [700, 259, 1]
    offs = offsets_from(lengths)
    n = max(lengths)
    for w in (1, 5, 63, 64, 65, 200, 256):
        bound = window_query_blocks(visibility(window=w), Tile(bm, bn, 4, 1))
        dense = dense_fixed(offs, n, max_attn_len=w)[:, 0]  # (B, N, N): row sees key
        worst = 0
        for b, L in enumerate(lengths):
            for n0 in range(0, L, bn):
                rows = dense[b, :, n0 : n0 + bn].any(dim=1).nonzero().flatten()
                if rows.numel():
                    worst = max(worst, int(rows.max()) // bm - int(rows.min()) // bm + 1)
        assert worst <= bound <= worst + 1, (w, worst, bound)
    nt = torch.tensor([3, 3, 0])
    for kw in (dict(window=8, num_targets=nt), dict(window=8, contextual=2), dict(window=8, min_full=4), {}):
        assert window_query_blocks(visibility(**kw), Tile(bm, bn, 4, 1)) == _NEVER_SPLIT, kw
