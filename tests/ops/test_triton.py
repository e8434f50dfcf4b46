"""Triton kernels (forward, dQ, dK/dV) against the reference, under TRITON_INTERPRET=1 on the CPU.

The interpreter runs the same kernels and block logic as the GPU, with small,
unequal blocks (BLOCK_M 32 / BLOCK_N 16 forward, 16 / 32 backward), so every
sequence here spans several query and key blocks and most lengths are not
block multiples. Every kernel runs with its outputs poisoned (NaN before the
launch, ``debug.poison_outputs``), so an element no kernel writes fails.

Dtypes: float32 and float16 only. bfloat16 cannot be checked here: Triton
3.6's interpreter computes a bare ``tl.dot`` on bf16 tiles wrongly (errors
around 1e10), so bf16 is covered by the GPU suite (tests/gpu) instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.triton.debug import poison_outputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a GPU",
)


def assert_matches_reference(*args, **kwargs) -> torch.Tensor:
    """``hstu_mha(*args, **kwargs)`` on Triton equals the reference: output and dq, dk, dv (q, k, v are
    ``args[2:5]``); returns the Triton output."""
    q, k, v = args[2:5]
    out = flexhstu.hstu_mha(*args, kernel=Kernel.TRITON, **kwargs)
    ref = flexhstu.hstu_mha(*args, kernel=Kernel.PYTORCH, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")
    return out


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    with poison_outputs():
        yield


LENGTHS = [37, 0, 70, 16, 5]
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"


def batch(lengths, heads=2, dqk=16, dv=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dqk, generator=g)
    k = torch.randn(total, heads, dqk, generator=g)
    v = torch.randn(total, heads, dv, generator=g)
    return [x.to(DEVICE, dtype).requires_grad_(True) for x in (q, k, v)]


def mask_case(name, offs, lengths, heads):
    n = max(lengths)
    t = sum(lengths)
    g = torch.Generator().manual_seed(11)
    if name == "causal":
        return {}
    if name == "non-causal":
        return dict(causal=False)
    if name == "fixed":
        return dict(num_targets=torch.tensor([min(5, L) for L in lengths]), max_attn_len=10, contextual_seq_len=3)
    if name == "fixed-targets":
        return dict(num_targets=torch.tensor([min(9, L) for L in lengths]))
    if name == "sla":
        return dict(attn_func=masks.sla(offs, 20, 4))
    if name == "sla-widened-7":
        return dict(attn_func=masks.widen(masks.sla(offs, 20, 4), 7))
    if name == "sla-widened-5-mixed":
        # Interval 2 live on some rows only: query blocks of two intervals (the kernels' two-interval copy of the
        # walk) beside blocks of three (the general copy), in one call.
        func = masks.widen(masks.sla(offs, 20, 4), 5).clone()
        rows = torch.arange(t)
        local = rows - offs[torch.searchsorted(offs, rows, right=True) - 1]
        live = (local >= 35) & (local % 7 != 0)
        func[0, 3] = torch.where(live, local // 3, 0).to(func.dtype)
        func[0, 4] = torch.where(live, local // 3 + 4, 0).to(func.dtype)
        return dict(attn_func=func)
    if name == "onerank":
        return dict(attn_func=masks.onerank(offs, torch.tensor([(L // 3) // 4 * 4 for L in lengths]), 4))
    if name == "causal-func":
        return dict(attn_func=masks.causal(offs))
    if name == "random-per-head-5":
        return dict(attn_func=torch.randint(-3, n + 3, (heads, 5, t), generator=g, dtype=torch.int32))
    if name == "random-7":
        return dict(attn_func=torch.randint(-3, n + 3, (1, 7, t), generator=g, dtype=torch.int32))
    if name == "random-9":  # five intervals: the general (non register-resident) path
        return dict(attn_func=torch.randint(-3, n + 3, (1, 9, t), generator=g, dtype=torch.int32))
    if name == "stride0-expanded":
        return dict(attn_func=masks.sla(offs, 9, 2, nheads=heads))
    raise KeyError(name)


CASES = [
    "causal",
    "non-causal",
    "fixed",
    "fixed-targets",
    "sla",
    "sla-widened-7",
    "sla-widened-5-mixed",
    "onerank",
    "causal-func",
    "random-per-head-5",
    "random-7",
    "random-9",
    "stride0-expanded",
]


def to_device(kw):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


@pytest.mark.parametrize("name", CASES)
def test_forward_and_gradients_match_the_reference(name):
    lengths = LENGTHS
    offs = offsets_from(lengths).to(DEVICE)
    heads = 2
    kw = to_device(mask_case(name, offs.cpu(), lengths, heads))
    q, k, v = batch(lengths, heads)
    n = max(lengths)
    assert_matches_reference(n, 0.3, q, k, v, offs, scaling_seqlen=50, **kw)


def test_unsorted_overlapping_intervals_are_counted_once():
    # Interval 2 lies before interval 1 and overlaps interval 0: each key block must be visited once.
    lengths = [64, 41]
    offs = offsets_from(lengths)
    i = torch.cat([torch.arange(L) for L in lengths])
    func = torch.stack([i // 2 + 1, i // 2 + 20, i + 1, torch.zeros_like(i), i // 2 + 8]).to(torch.int32)[None]
    q, k, v = batch(lengths, heads=1, dqk=16, dv=16, seed=3)
    out = flexhstu.hstu_mha(64, None, q, k, v, offs.to(DEVICE), attn_func=func.to(DEVICE), kernel=Kernel.TRITON)
    ref = flexhstu.hstu_mha(64, None, q, k, v, offs.to(DEVICE), attn_func=func.to(DEVICE), kernel=Kernel.PYTORCH)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_half_precision_stays_close_to_float32():
    lengths = [33, 18]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v = batch(lengths, heads=1, dqk=16, dv=16, dtype=torch.float16, seed=4)
    out = flexhstu.hstu_mha(33, None, q, k, v, offs, attn_func=masks.sla(offs, 8, 3), kernel=Kernel.TRITON)
    ref = flexhstu.hstu_mha(
        33, None, q.float(), k.float(), v.float(), offs, attn_func=masks.sla(offs, 8, 3), kernel=Kernel.PYTORCH
    )
    assert out.dtype == torch.float16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_all_empty_batch_returns_empty():
    offs = offsets_from([0, 0]).to(DEVICE)
    q, k, v = batch([0, 0])
    out = flexhstu.hstu_mha(0, None, q, k, v, offs, kernel=Kernel.TRITON)
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("name", ["causal", "fixed", "sla"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_eager_and_compiled_paths_match_the_reference_with_gradients(name, compiled):
    # The compiled path runs the custom ops (forward, backward) instead of the eager autograd.Function.
    lengths = [37, 0, 21]
    offs = offsets_from(lengths).to(DEVICE)
    kw = to_device(mask_case(name, offs.cpu(), lengths, 1))
    q, k, v = batch(lengths, heads=1, dqk=16, dv=16, seed=7)
    dout = torch.randn(sum(lengths), 1, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)

    def attention(q, k, v, kernel):
        return flexhstu.hstu_mha(37, None, q, k, v, offs, kernel=kernel, **kw)

    run = torch.compile(attention, fullgraph=True, backend="aot_eager") if compiled else attention
    out = run(q, k, v, Kernel.TRITON)
    ref = attention(q, k, v, Kernel.PYTORCH)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


def test_poisoned_outputs_start_as_nan_and_the_kernels_overwrite_them():
    from flexhstu.ops.triton.launch import _new_like

    x = torch.zeros(3, 2)
    assert torch.isnan(_new_like(x)).all()
    lengths = [21, 3]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v = batch(lengths, heads=1)
    out = flexhstu.hstu_mha(21, None, q, k, v, offs, kernel=Kernel.TRITON)
    assert not torch.isnan(out).any()


def test_tile_override_applies_inside_the_block_only_and_keeps_the_result():
    from flexhstu.ops.triton.config import Tile, tile_override, tiles

    small = Tile(16, 64, 4, 1)
    before = tiles(16, 32, True)
    lengths = [70, 37]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v = batch(lengths)
    kw = dict(attn_func=masks.sla(offs.cpu(), 20, 4).to(DEVICE))
    ref = flexhstu.hstu_mha(70, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **kw)
    with tile_override(forward=small, dkdv=small):
        assert tiles(16, 32, True) == before._replace(forward=small, dkdv=small)
        out = flexhstu.hstu_mha(70, 0.3, q, k, v, offs, kernel=Kernel.TRITON, **kw)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert tiles(16, 32, True) == before
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for g, w in zip((dq, dk, dv), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("max_seq_len", [0, 1, 40, 10_000])
def test_max_seq_len_is_only_a_hint_for_the_key_major_split(max_seq_len):
    # Sequences of up to 7 query blocks of the interpreter's key-major tile (16 rows), split in chunks of 2:
    # every max_seq_len (0, too small, too large) must give the reference dK/dV.
    from flexhstu.ops.triton import triton_hstu_mha

    lengths = [100, 0, 45]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v = batch(lengths, heads=1)
    func = masks.sla(offs.cpu(), 40, 8).to(DEVICE)
    out = triton_hstu_mha(q, k, v, offs, func=func, alpha=0.3, out_scale=1 / 100, max_seq_len=max_seq_len)
    ref = flexhstu.hstu_mha(100, 0.3, q, k, v, offs, attn_func=func, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("name", ["causal", "sla"])
def test_key_blocks_cut_into_more_pieces_than_allowed_match_the_reference(name):
    # The interpreter cuts key-major ranges into pieces of 2 query blocks (16 rows), at most 4 pieces, taken by 3
    # workers: a 200-row sequence gives key blocks of 13 query blocks (the last piece runs to the end), and more
    # pieces than workers (each worker takes several).
    from flexhstu.ops.triton import triton_hstu_mha

    lengths = [200, 0, 45]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v = batch(lengths, heads=1)
    func = masks.causal(offs.cpu()) if name == "causal" else masks.sla(offs.cpu(), 40, 8)
    out = triton_hstu_mha(q, k, v, offs, func=func.to(DEVICE), alpha=0.3, out_scale=1 / 200, max_seq_len=200)
    ref = flexhstu.hstu_mha(200, 0.3, q, k, v, offs, attn_func=func.to(DEVICE), kernel=Kernel.PYTORCH)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


def _strided(x):
    """The same values as ``x`` (1-D), in a view with stride 2."""
    return torch.stack([x, torch.full_like(x, -7)], 1)[:, 0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_strided_seq_offsets_give_the_same_output(dtype):
    lengths = [37, 0, 70, 16]
    offs = offsets_from(lengths, dtype=dtype).to(DEVICE)
    q, k, v = batch(lengths)
    kw = dict(kernel=Kernel.TRITON, attn_func=masks.sla(offs.cpu(), 20, 4).to(DEVICE))
    want = flexhstu.hstu_mha(70, None, q, k, v, offs, **kw)
    strided = _strided(offs)
    assert strided.stride(0) == 2
    got = flexhstu.hstu_mha(70, None, q, k, v, strided, **kw)
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert torch.equal(g, w)


def test_strided_num_targets_give_the_same_output():
    lengths = [37, 0, 70, 16]
    offs = offsets_from(lengths).to(DEVICE)
    nt = torch.tensor([9, 0, 20, 3], device=DEVICE)
    q, k, v = batch(lengths)
    kw = dict(kernel=Kernel.TRITON, max_attn_len=10, contextual_seq_len=2)
    want = flexhstu.hstu_mha(70, None, q, k, v, offs, num_targets=nt, **kw)
    got = flexhstu.hstu_mha(70, None, q, k, v, offs, num_targets=_strided(nt), **kw)
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("layout", ["fused-projection", "heads-first", "last-dim-stride-2"])
def test_strided_qkv_give_the_same_output(layout):
    lengths = [37, 0, 21]
    total, heads, d = sum(lengths), 2, 16
    offs = offsets_from(lengths).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    if layout == "fused-projection":  # slices of one (total, H, 3 D) projection
        q, k, v = torch.randn(total, heads, 3 * d, generator=g).to(DEVICE).split(d, dim=2)
    elif layout == "heads-first":  # (H, total, D) storage seen as (total, H, D)
        q, k, v = (torch.randn(heads, total, d, generator=g).to(DEVICE).transpose(0, 1) for _ in range(3))
    else:
        q, k, v = (torch.randn(total, heads, 2 * d, generator=g).to(DEVICE)[..., ::2] for _ in range(3))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    assert not q.is_contiguous()
    dense = [x.detach().contiguous().requires_grad_(True) for x in (q, k, v)]
    kw = dict(kernel=Kernel.TRITON, attn_func=masks.sla(offs.cpu(), 9, 3).to(DEVICE))
    got = flexhstu.hstu_mha(37, None, q, k, v, offs, **kw)
    want = flexhstu.hstu_mha(37, None, *dense, offs, **kw)
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, dense, dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["causal", "fixed", "func"])
@pytest.mark.parametrize("dqk,dv", [(24, 24), (48, 48), (20, 40), (8, 12)])
def test_head_dims_that_are_not_powers_of_two_match_the_reference(dqk, dv, mode):
    lengths = [37, 0, 21]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v = batch(lengths, heads=1, dqk=dqk, dv=dv, seed=dqk + dv)
    kw = {
        "causal": {},
        "fixed": dict(num_targets=torch.tensor([5, 0, 4], device=DEVICE), max_attn_len=9, contextual_seq_len=2),
        "func": dict(attn_func=masks.sla(offs.cpu(), 9, 3).to(DEVICE)),
    }[mode]
    out = assert_matches_reference(37, None, q, k, v, offs, **kw)
    assert out.shape == (sum(lengths), 1, dv)


def test_head_dim_above_the_limit_is_rejected_naming_the_argument():
    from flexhstu.ops.triton import triton_hstu_mha
    from flexhstu.ops.triton.limits import MAX_HEAD_DIM, head_dim_supported

    assert head_dim_supported(MAX_HEAD_DIM) and not head_dim_supported(MAX_HEAD_DIM + 1)
    q = torch.zeros(4, 1, 16, device=DEVICE)
    v = torch.zeros(4, 1, MAX_HEAD_DIM + 1, device=DEVICE)
    with pytest.raises(ValueError, match=r"v.shape\[2\] \(Dv\).*got 257"):
        triton_hstu_mha(q, q, v, offsets_from([4]).to(DEVICE), alpha=1.0, out_scale=1.0, max_seq_len=4)


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_fp32_dot_precision_follows_allow_tf32(allow_tf32):
    # The interpreter computes both precisions exactly, so this checks the constexpr the kernels are launched with.
    from flexhstu.ops.triton.block_plan import Visibility
    from flexhstu.ops.triton.launch import _attention_args
    from flexhstu.ops.triton.row_intervals import MODE_CAUSAL

    offs = offsets_from([4])
    x32, x16 = torch.zeros(4, 1, 16), torch.zeros(4, 1, 16, dtype=torch.float16)
    vis = Visibility(int(MODE_CAUSAL))
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        fp32 = _attention_args(x32, x32, x32, offs, vis, 1.0, True)["DOT_PRECISION"]
        fp16 = _attention_args(x16, x16, x16, offs, vis, 1.0, True)["DOT_PRECISION"]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert fp32 == ("tf32" if allow_tf32 else "ieee")
    assert fp16 == "tf32"


@pytest.mark.parametrize("name", ["causal", "fixed", "sla"])
def test_nan_and_inf_in_one_sequence_never_reach_another(name):
    lengths = [37, 21, 30]
    offs = offsets_from(lengths).to(DEVICE)
    kw = to_device(mask_case(name, offs.cpu(), lengths, 1))
    clean = batch(lengths, heads=1, dqk=16, dv=16, seed=9)
    dout = torch.randn(sum(lengths), 1, 16, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    bad = slice(37, 58)  # sequence 1
    dirty = [x.detach().clone() for x in clean]
    for x, value in zip(dirty, (float("nan"), float("inf"), float("nan"))):
        x[bad][::2] = value
        x[bad][1::3] = -float("inf")
    dirty = [x.requires_grad_(True) for x in dirty]
    dout_dirty = dout.clone()
    dout_dirty[bad][::4] = float("nan")
    results = []
    for (q, k, v), do in ((clean, dout), (dirty, dout_dirty)):
        out = flexhstu.hstu_mha(37, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[bad] = False
    for c, d, what in zip(*results, ("out", "dq", "dk", "dv")):
        assert torch.isfinite(d[keep]).all(), what
        assert torch.equal(c[keep], d[keep]), what
    assert not torch.isfinite(results[1][0][bad]).all()  # the poisoned sequence itself is affected


@pytest.mark.parametrize("bad", [[0, 6, 15, 40], [3, 1, 7, 2, 19], [-5, 4, 30, 19], [0, 19, 4, 19], [0, 5, 12]])
@pytest.mark.parametrize("mask", ["causal", "sla"])
def test_offsets_that_break_the_rules_keep_the_kernels_inside_their_buffers(bad, mask):
    # On CUDA hstu_mha does not read the offsets (no host sync), so nothing refuses these before the kernels. They
    # follow ``safe_offsets`` instead (clamped, non-decreasing, 0 first, total last): in bounds (the interpreter
    # raises on an out-of-bounds access; the audit saw a double free), every row written, and equal to the
    # reference on the offsets made safe.
    from flexhstu.ops.triton import triton_hstu_mha
    from flexhstu.ops.triton.block_tables import safe_offsets

    total = 19
    bad = torch.tensor(bad, dtype=torch.int64, device=DEVICE)
    safe = safe_offsets(bad, total)
    q, k, v = batch([total])
    func = masks.sla(safe.cpu(), 5, 2).to(DEVICE) if mask == "sla" else None
    kw = dict(alpha=0.3, out_scale=0.05, max_seq_len=20)
    got = triton_hstu_mha(q, k, v, bad, func=func, causal_closed_form=func is None, **kw)
    want = flexhstu.hstu_mha(20, 0.3, q, k, v, safe, attn_func=func, scaling_seqlen=20, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
