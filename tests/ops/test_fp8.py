"""e4m3 inputs to the delta forward: the kernel (interpreter) against the PyTorch reference (the attention of the
dequantized values), and both against full precision within e4m3's error."""

from __future__ import annotations

import pytest
import torch
from test_delta_triton import batch, mask_keywords, slotted

import flexhstu
from flexhstu import Kernel, dequantize_fp8, quantize_fp8
from flexhstu.ops.fp8 import E4M3
from flexhstu.ops.triton.delta_op import forced_key_splits

MASKS = ["causal", "fixed", "onerank", "sla", "random-per-head"]


def quantized(q, k, v):
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    return q8, k8, v8, (qs, ks, vs)


def delta(q, k, v, offs, q_offsets, q_start, kernel, **kw):
    return flexhstu.delta_hstu_mha(80, 0.3, q, k, v, offs, q_offsets=q_offsets, q_start=q_start, kernel=kernel, **kw)


def test_quantize_keeps_each_row_within_e4m3_rounding_of_its_largest_value():
    x = torch.randn(50, 3, 24, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    x8, scale = quantize_fp8(x)
    assert x8.dtype == E4M3 and scale.shape == (50, 3) and scale.dtype == torch.float32
    assert scale[7, 1] == 1 and (x8[7, 1].float() == 0).all()
    big = x.abs().amax(dim=2, keepdim=True)
    assert (dequantize_fp8(x8, scale).abs().amax(dim=2, keepdim=True) - big).abs().max() <= 1e-6 * big.max()
    err = (dequantize_fp8(x8, scale) - x).abs()
    assert (err <= big * 2.0**-4 * 1.0001).all()  # 3 mantissa bits: half a step at the top binade
    assert (err > 0).any()


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.zeros(4, 8), r"x: expected a 3-D jagged tensor \(rows, H, D\), got shape \(4, 8\)"),
        (torch.zeros(4, 2, 8, dtype=torch.int32), r"x.dtype: expected float16, bfloat16, float32 or float64"),
        (torch.zeros(4, 2, 8).to(E4M3), r"x.dtype: expected float16, bfloat16, float32 or float64"),
        (torch.zeros(4, 2, 0), r"x.shape\[2\] \(D\): expected at least 1 value a row and head to scale, got 0"),
    ],
)
def test_quantize_names_a_bad_input(x, match):
    with pytest.raises((TypeError, ValueError), match=match):
        quantize_fp8(x)


@pytest.mark.parametrize(
    "scale, match",
    [
        (torch.ones(4, 1), r"scale.shape: expected x8.shape\[:2\] of a 3-D x8, \(4, 2\), got \(4, 1\)"),
        (torch.ones(1, 2), r"scale.shape: expected x8.shape\[:2\] of a 3-D x8, \(4, 2\), got \(1, 2\)"),
        (torch.ones(4), r"scale.shape: expected x8.shape\[:2\] of a 3-D x8, \(4, 2\), got \(4,\)"),
    ],
)
def test_dequantize_names_a_scale_of_another_shape(scale, match):
    # Broadcasting would apply one row's (or one head's) scale to all of them.
    x8, _ = quantize_fp8(torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match=match):
        dequantize_fp8(x8, scale)


@pytest.mark.parametrize("name", MASKS)
def test_triton_fp8_delta_equals_the_reference(name):
    q, k, v, offs, rows, q_offsets, q_start = batch()
    _, delta_kw = mask_keywords(name, offs, rows)
    q8, k8, v8, scales = quantized(q[rows], k, v)
    with torch.no_grad():
        want = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.PYTORCH, fp8_scales=scales, **delta_kw)
        got = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.TRITON, fp8_scales=scales, **delta_kw)
    assert got.dtype == want.dtype == torch.bfloat16
    assert want.abs().max() > 0
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-3 * want.abs().max().item())


def test_the_e4m3_reference_is_the_attention_of_the_dequantized_values():
    q, k, v, offs, rows, q_offsets, q_start = batch()
    q8, k8, v8, (qs, ks, vs) = quantized(q[rows], k, v)
    got = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.PYTORCH, fp8_scales=(qs, ks, vs))
    deq = (dequantize_fp8(q8, qs), dequantize_fp8(k8, ks), dequantize_fp8(v8, vs))
    want = delta(*deq, offs, q_offsets, q_start, Kernel.PYTORCH)
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["causal", "sla"])
def test_fp8_delta_stays_within_e4m3_error_of_full_precision(name):
    q, k, v, offs, rows, q_offsets, q_start = batch()
    _, delta_kw = mask_keywords(name, offs, rows)
    q8, k8, v8, scales = quantized(q[rows], k, v)
    full = delta(q[rows], k, v, offs, q_offsets, q_start, Kernel.PYTORCH, **delta_kw)
    got = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.TRITON, fp8_scales=scales, **delta_kw).float()
    rel = (got - full).norm() / full.norm()
    assert 1e-3 < rel < 0.08, rel  # e4m3 rounds each of q, k and v to 3 mantissa bits


@pytest.mark.parametrize("splits", [2, 16])
def test_fp8_key_splits_add_up_to_the_unsplit_call(splits):
    q, k, v, offs, rows, q_offsets, q_start = batch()
    q8, k8, v8, scales = quantized(q[rows], k, v)
    with forced_key_splits(1):
        want = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.TRITON, fp8_scales=scales)
    with forced_key_splits(splits):
        got = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.TRITON, fp8_scales=scales)
    # The same roundings, summed in another order and rounded to bfloat16 once more: a bfloat16 step at most.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("kernel", [Kernel.TRITON, Kernel.PYTORCH])
def test_fp8_kv_lengths_read_only_the_used_rows_and_their_scales(kernel):
    # Spare rows hold NaN, so their scales are NaN too: reading either would give NaN.
    q, k, v, offs, rows, q_offsets, q_start = batch()
    ks, vs, slot_offs, lengths = slotted(k, v, offs, room=[5, 3, 0, 17])
    q8, k8, v8, scales = quantized(q[rows], k, v)
    want = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.PYTORCH, fp8_scales=scales)
    q8, ks8, vs8, slot_scales = quantized(q[rows], ks, vs)
    assert slot_scales[1].isnan().any()
    with forced_key_splits(2):
        got = delta(q8, ks8, vs8, slot_offs, q_offsets, q_start, kernel, fp8_scales=slot_scales, kv_lengths=lengths)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-3 * want.abs().max().item())


def test_e4m3_kernels_need_compute_capability_8_9():
    from flexhstu.ops.capability import e4m3_reason

    assert e4m3_reason((9, 0)) is None and e4m3_reason((8, 9)) is None
    assert (
        e4m3_reason((8, 0))
        == "q.dtype: expected a GPU of compute capability 8.9 or more for e4m3 Kernel.TRITON, got 8.0"
    )


@pytest.mark.parametrize("q_big, k_small", [(1e37, 1e-33), (1e36, 1e-36)])
def test_a_huge_query_scale_times_a_tiny_key_scale_stays_finite(q_big, k_small):
    # The e4m3 dot reaches 448^2 * D: times the query's scale alone it would overflow to inf (silu(-inf) * 0 is
    # NaN), while times both scales it is finite, as the reference's dequantized product is.
    q, k, v, offs, rows, q_offsets, q_start = batch()
    q8, k8, v8, (qs, ks, vs) = quantized(q[rows], k, v)
    scales = (qs * q_big, ks * k_small, vs)
    with torch.no_grad():
        want = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.PYTORCH, fp8_scales=scales)
        got = delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.TRITON, fp8_scales=scales)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-3 * want.abs().max().item())


def test_quantize_keeps_rows_of_tiny_values_finite():
    x8, scale = quantize_fp8(torch.tensor([[[1e-44, 0.0, -5e-45]]]))
    assert torch.isfinite(x8.float()).all() and (scale > 0).all()


def test_scales_that_require_grad_are_refused_as_the_inputs_are():
    q, k, v, offs, rows, q_offsets, q_start = batch()
    q8, k8, v8, (qs, ks, vs) = quantized(q[rows], k, v)
    with pytest.raises(RuntimeError, match=r"forward-only .*requires_grad: k_scale"):
        delta(q8, k8, v8, offs, q_offsets, q_start, Kernel.PYTORCH, fp8_scales=(qs, ks.requires_grad_(), vs))


def test_fp8_calls_name_what_is_wrong():
    q, k, v, offs, rows, q_offsets, q_start = batch()
    q8, k8, v8, (qs, ks, vs) = quantized(q[rows], k, v)
    run = lambda *x, **kw: delta(*x, offs, q_offsets, q_start, Kernel.PYTORCH, **kw)
    with pytest.raises(TypeError, match=r"delta_q: expected .*\(float8_e4m3fn inputs need fp8_scales\)"):
        run(q8, k8, v8)
    with pytest.raises(TypeError, match=r"k.dtype: expected torch.float8_e4m3fn with fp8_scales"):
        run(q8, k, v8, fp8_scales=(qs, ks, vs))
    with pytest.raises(TypeError, match=r"fp8_scales: expected a tuple \(q_scale, k_scale, v_scale\)"):
        run(q8, k8, v8, fp8_scales=(qs, ks))
    with pytest.raises(ValueError, match=r"fp8_scales k_scale: expected shape \(119, 2\) \(rows, H\) of its input"):
        run(q8, k8, v8, fp8_scales=(qs, ks[:-1], vs))
    with pytest.raises(TypeError, match=r"fp8_scales v_scale.dtype: expected torch.float32, got torch.float16"):
        run(q8, k8, v8, fp8_scales=(qs, ks, vs.half()))


def test_the_training_op_refuses_e4m3_and_names_where_it_runs():
    x = torch.zeros(4, 2, 16).to(E4M3)
    with pytest.raises(
        TypeError, match=r"q: expected .* \(e4m3 runs in delta_hstu_mha only\), got torch.float8_e4m3fn"
    ):
        flexhstu.hstu_mha(4, None, x, x, x, torch.tensor([0, 4]))


def test_the_kernel_reads_strided_scales_given_to_it_directly():
    # triton_delta_hstu_mha skips delta_hstu_mha's checks: scales that are column slices still read right.
    from flexhstu.ops.triton.delta_op import triton_delta_hstu_mha

    q, k, v, offs, rows, q_offsets, q_start = batch()
    q8, k8, v8, scales = quantized(q[rows], k, v)
    want = triton_delta_hstu_mha(q8, k8, v8, offs, q_offsets, q_start, alpha=0.3, out_scale=1 / 80, fp8_scales=scales)
    wide = [torch.stack([s, torch.full_like(s, float("nan"))], dim=2)[:, :, 0] for s in scales]
    assert not wide[0].is_contiguous()
    got = triton_delta_hstu_mha(q8, k8, v8, offs, q_offsets, q_start, alpha=0.3, out_scale=1 / 80, fp8_scales=wide)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
