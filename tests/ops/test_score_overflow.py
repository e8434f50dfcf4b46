"""Scores beyond float32's range: one that overflows to -inf has silu 0 (the exact limit), not NaN."""

from __future__ import annotations

import os

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks

KERNELS = [
    Kernel.PYTORCH,
    pytest.param(
        Kernel.TRITON,
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton kernel on CPU"
        ),
    ),
]


def _inputs(negative_only: bool):
    gen = torch.Generator().manual_seed(0)
    offs = offsets_from([7, 5, 0, 19])
    total = int(offs[-1])
    q, k, v = (torch.randn(total, 2, 16, generator=gen) for _ in range(3))
    if negative_only:  # every q.k < 0: with alpha 1e38 every score overflows to -inf in float32
        q, k = -(q.abs() + 0.5), k.abs() + 0.5
    return q, k, v, offs


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mask", ["causal", "sla"])
def test_scores_overflowing_below_give_the_float64_result_and_finite_gradients(kernel, mask):
    q, k, v, offs = _inputs(negative_only=True)
    kw = {"attn_func": masks.sla(offs, 3, 2)} if mask == "sla" else {}
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = flexhstu.hstu_mha(19, 1e38, *leaves, offs, kernel=kernel, **kw)
    want = flexhstu.hstu_mha(19, 1e38, q.double(), k.double(), v.double(), offs, kernel=Kernel.PYTORCH, **kw)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-30)
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_input_still_gives_nan_in_its_rows(kernel):
    # Raising -inf scores must not turn a NaN score into a finite one.
    q, k, v, offs = _inputs(negative_only=False)
    q[0, 0, 0] = float("nan")
    out = flexhstu.hstu_mha(19, 1.0, q, k, v, offs, kernel=kernel)
    assert out[0, 0].isnan().all() and torch.isfinite(out[7:]).all()
