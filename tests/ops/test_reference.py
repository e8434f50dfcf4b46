"""hstu_mha(PYTORCH) against an independent per-sequence float64 computation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rules import dense_attention_f64, offsets_from

import flexhstu
from flexhstu import Kernel, masks


def make_batch(lengths, heads=2, dqk=8, dv=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, dqk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(total, heads, dv, generator=g, dtype=dtype)
    return q, k, v


def mask_cases(lengths):
    offs = offsets_from(lengths)
    nt = torch.tensor([min(2, L) for L in lengths])
    ncand = torch.tensor([(L // 3) // 3 * 3 for L in lengths])
    g = torch.Generator().manual_seed(5)
    rand5 = torch.randint(-1, max(lengths) + 2, (2, 5, sum(lengths)), generator=g, dtype=torch.int32)
    return {
        "causal": masks.causal(offs),
        "fixed": masks.fixed(offs, num_targets=nt, max_attn_len=3, contextual_seq_len=2),
        "sla": masks.sla(offs, 3, 2),
        "onerank": masks.onerank(offs, ncand, 3),
        "random-per-head": rand5,
    }


LENGTHS = [7, 0, 11, 4]


@pytest.mark.parametrize("name", ["causal", "fixed", "sla", "onerank", "random-per-head"])
def test_forward_and_gradients_match_per_sequence_float64(name):
    lengths = LENGTHS
    offs = offsets_from(lengths)
    n = max(lengths)
    func = mask_cases(lengths)[name]
    q, k, v = make_batch(lengths)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    alpha, scale = 0.37, 9.0
    out = flexhstu.hstu_mha(n, alpha, q, k, v, offs, attn_func=func, scaling_seqlen=9, kernel=Kernel.PYTORCH)
    vis = masks.to_dense(func, offs, n)
    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = dense_attention_f64(qr, kr, vr, lengths, vis, alpha, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_fixed_rule_without_func_equals_the_built_func():
    lengths = [9, 3, 0, 12]
    offs = offsets_from(lengths)
    nt = torch.tensor([2, 1, 0, 4])
    q, k, v = make_batch(lengths, seed=3)
    kw = dict(num_targets=nt, max_attn_len=4, contextual_seq_len=2, min_full_attn_seq_len=3)
    a = flexhstu.hstu_mha(12, None, q, k, v, offs, kernel=Kernel.PYTORCH, **kw)
    b = flexhstu.hstu_mha(12, None, q, k, v, offs, attn_func=masks.fixed(offs, **kw), kernel=Kernel.PYTORCH)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_shared_mask_equals_expanded_mask_and_defaults_apply():
    lengths = [5, 8]
    offs = offsets_from(lengths)
    q, k, v = make_batch(lengths, heads=3)
    f1 = masks.sla(offs, 2, 1)
    a = flexhstu.hstu_mha(8, None, q, k, v, offs, attn_func=f1)
    b = flexhstu.hstu_mha(8, None, q, k, v, offs, attn_func=f1.expand(3, 3, 13))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = dense_attention_f64(q, k, v, lengths, masks.to_dense(f1, offs, 8), 8**-0.5, 8.0)
    torch.testing.assert_close(a, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_dtypes_stay_close_to_float64(dtype):
    lengths = [6, 9]
    offs = offsets_from(lengths)
    q, k, v = make_batch(lengths, dtype=dtype)
    out = flexhstu.hstu_mha(9, 0.5, q, k, v, offs, kernel=Kernel.PYTORCH)
    assert out.dtype == dtype
    ref = dense_attention_f64(q, k, v, lengths, masks.to_dense(masks.causal(offs), offs, 9), 0.5, 9.0)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


def attention_matrix(lengths, q, k, **kw):
    """(H, L, L) attention matrix ``A`` of a one-sequence batch, read through one-hot values.

    With ``v[j, h] = e_j``, output row ``i`` of head ``h`` is row ``i`` of ``A``.
    """
    (n,) = lengths
    v = torch.eye(n, dtype=q.dtype)[:, None, :].expand(n, q.shape[1], n)
    out = flexhstu.hstu_mha(n, None, q, k, v, offsets_from(lengths), kernel=Kernel.PYTORCH, **kw)
    return out.permute(1, 0, 2)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_zeroes_a_fraction_p_and_rescales_the_rest_only_in_training(p):
    lengths = [64]
    q, k, _ = make_batch(lengths)
    base = attention_matrix(lengths, q, k)
    torch.testing.assert_close(attention_matrix(lengths, q, k, dropout_pr=p, training=False), base, rtol=0, atol=0)
    torch.manual_seed(0)
    dropped = attention_matrix(lengths, q, k, dropout_pr=p, training=True)
    visible = base != 0  # causal: silu(s) is 0 only where the mask hides the pair
    assert int(visible.sum()) == 2 * 64 * 65 // 2
    assert not dropped[~visible].any()
    kept = visible & (dropped != 0)
    n = int(visible.sum())
    zeroed = 1 - int(kept.sum()) / n
    assert abs(zeroed - p) <= 5 * (p * (1 - p) / n) ** 0.5  # five binomial standard deviations
    torch.testing.assert_close(dropped[kept], base[kept] / (1 - p), rtol=1e-12, atol=0)


@given(
    lengths=st.lists(st.integers(0, 9), min_size=2, max_size=4),
    seed=st.integers(0, 1000),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_strided_offsets_targets_and_funcs_give_the_same_output(lengths, seed, dtype):
    offs = offsets_from(lengths, dtype)
    nt = torch.tensor([L // 2 for L in lengths])
    strided_offs = torch.stack([offs, torch.full_like(offs, -7)], 1)[:, 0]  # stride 2; the gaps hold garbage
    strided_nt = torch.stack([nt, torch.full_like(nt, 99)], 1)[:, 0]
    assert not strided_offs.is_contiguous() and not strided_nt.is_contiguous()
    total, n = sum(lengths), max(max(lengths), 1)
    func = torch.randint(-1, n + 2, (2, 5, total), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    strided_func = torch.empty(total, 5, 2, dtype=torch.int32).permute(2, 1, 0).copy_(func)
    assert total < 2 or not strided_func.is_contiguous()
    shared = masks.sla(offs, 2, 1)
    q, k, v = make_batch(lengths, seed=seed)

    def run(o, **kw):
        return flexhstu.hstu_mha(n, None, q, k, v, o, kernel=Kernel.PYTORCH, **kw)

    same = [
        (run(offs, num_targets=nt, max_attn_len=2), run(strided_offs, num_targets=strided_nt, max_attn_len=2)),
        (run(offs, attn_func=func), run(strided_offs, attn_func=strided_func)),
        (run(offs, attn_func=shared.expand(2, 3, total).contiguous()), run(offs, attn_func=shared.expand(2, 3, total))),
        (masks.fixed(offs, num_targets=nt), masks.fixed(strided_offs, num_targets=strided_nt)),
    ]
    for want, got in same:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def run_with_grads(lengths, q, k, v, **kw):
    """Output and (dq, dk, dv) of hstu_mha(PYTORCH) for a fixed upstream gradient."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = flexhstu.hstu_mha(max(lengths), None, q, k, v, offsets_from(lengths), kernel=Kernel.PYTORCH, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out, torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("mask", ["causal", "sla-func"])
def test_non_finite_input_in_one_sequence_leaves_the_others_untouched(which, bad, mask):
    # Sequence 1 is poisoned; sequence 0 is shorter than the longest, so its padding
    # gathers rows of sequence 1, and sequence 2 is last.
    lengths = [5, 7, 4]
    offs = offsets_from(lengths)
    kw = {"attn_func": masks.sla(offs, 2, 1)} if mask == "sla-func" else {}
    q, k, v = make_batch(lengths, seed=2)
    clean, clean_grads = run_with_grads(lengths, q, k, v, **kw)
    poisoned = dict(q=q.clone(), k=k.clone(), v=v.clone())
    poisoned[which][[6, 9], 1, 0] = bad  # rows 1 and 4 of sequence 1; row 6 is in sequence 0's padding
    out, grads = run_with_grads(lengths, **poisoned, **kw)
    others = torch.cat([torch.arange(0, 5), torch.arange(12, 16)])
    for got, want in zip((out, *grads), (clean, *clean_grads)):
        assert bool(got[others].isfinite().all())
        torch.testing.assert_close(got[others], want[others], rtol=1e-12, atol=1e-12)


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 1000), data=st.data())
def test_nan_key_hidden_from_a_row_does_not_reach_that_row(lengths, seed, data):
    offs = offsets_from(lengths)
    total = sum(lengths)
    func = torch.randint(
        -1, max(lengths) + 2, (2, 5, total), generator=torch.Generator().manual_seed(seed), dtype=torch.int32
    )
    b = data.draw(st.integers(0, len(lengths) - 1))
    j = data.draw(st.integers(0, lengths[b] - 1))
    q, k, v = make_batch(lengths, seed=seed)
    clean = flexhstu.hstu_mha(max(lengths), None, q, k, v, offs, attn_func=func, kernel=Kernel.PYTORCH)
    k[int(offs[b]) + j] = float("nan")
    out = flexhstu.hstu_mha(max(lengths), None, q, k, v, offs, attn_func=func, kernel=Kernel.PYTORCH)
    sees = masks.to_dense(func, offs, max(lengths))[b, :, :, j]  # (Hf, N): which rows of sequence b see key j
    for h in range(2):
        blind = torch.ones(total, dtype=torch.bool)
        blind[int(offs[b]) : int(offs[b + 1])] = ~sees[h, : lengths[b]]
        torch.testing.assert_close(out[blind, h], clean[blind, h], rtol=0, atol=0)
        assert bool(out[~blind, h].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_large_inputs_matches_float64(dtype):
    """Scores of magnitude ~1e4-1e5 overflow float16 (silu(-inf) is NaN); float32 holds them."""
    lengths = [6, 9]
    offs = offsets_from(lengths)
    q, k, v = make_batch(lengths, dtype=torch.float64, seed=4)
    q, k = (100 * q).to(dtype), (100 * k).to(dtype)
    v = v.to(dtype)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = flexhstu.hstu_mha(9, None, q, k, v, offs, scaling_seqlen=900, kernel=Kernel.PYTORCH)
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    vis = masks.to_dense(masks.causal(offs), offs, 9)
    ref = dense_attention_f64(qr, kr, vr, lengths, vis, 8**-0.5, 900.0)
    assert ref.abs().max() < 1e4  # representable in both dtypes: any NaN/Inf is the op's
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert bool(got.isfinite().all())
        assert (got.double() - want).norm() <= tol * want.norm()


def test_padding_follows_the_longest_sequence_not_max_seq_len():
    # Padding to max_seq_len would allocate (B, H, N, N) scores: 64 GiB here.
    lengths = [4, 6]
    q, k, v = make_batch(lengths)
    offs = offsets_from(lengths)
    huge = flexhstu.hstu_mha(65536, None, q, k, v, offs, scaling_seqlen=6, kernel=Kernel.PYTORCH)
    tight = flexhstu.hstu_mha(6, None, q, k, v, offs, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(huge, tight, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["causal", "fixed", "onerank"])
def test_per_row_attn_scale_multiplies_each_query_row_forward_and_backward(name):
    lengths = LENGTHS
    offs = offsets_from(lengths)
    n = max(lengths)
    func = mask_cases(lengths)[name]
    q, k, v = make_batch(lengths, seed=4)
    scale = torch.rand(sum(lengths), dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.1
    inputs = [x.clone().requires_grad_(True) for x in (q, k, v, scale)]
    out = flexhstu.hstu_mha(n, 0.4, *inputs[:3], offs, attn_func=func, attn_scale=inputs[3], kernel=Kernel.PYTORCH)
    ref_inputs = [x.clone().requires_grad_(True) for x in (q, k, v, scale)]
    qr, kr, vr, sr = ref_inputs
    vis = masks.to_dense(func, offs, n)
    ref = dense_attention_f64(qr, kr, vr, lengths, vis, 0.4, 1.0) * sr[:, None, None]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, ref_inputs, dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_scalar_attn_scale_equals_the_reciprocal_scaling_seqlen():
    lengths = [6, 0, 9]
    offs = offsets_from(lengths)
    q, k, v = make_batch(lengths, seed=2)
    kw = dict(num_targets=torch.tensor([2, 0, 3]), kernel=Kernel.PYTORCH)
    a = flexhstu.hstu_mha(9, None, q, k, v, offs, attn_scale=torch.tensor(0.25, dtype=torch.float64), **kw)
    b = flexhstu.hstu_mha(9, None, q, k, v, offs, scaling_seqlen=4, **kw)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a, flexhstu.hstu_mha(9, None, q, k, v, offs, **kw))  # the default 1/9 differs
