"""attn_scale in the Triton kernels: row t of A is scaled by attn_scale[t] instead of 1 / scaling
(docs/design.md, section 10), in the forward and both backward kernels. Under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.triton import triton_hstu_mha
from flexhstu.ops.triton.debug import poison_outputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a GPU",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
LENGTHS = [37, 0, 70, 5]


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    with poison_outputs():
        yield


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q, k = (torch.randn(total, 2, 16, generator=g) for _ in range(2))
    v = torch.randn(total, 2, 32, generator=g)
    scale = torch.rand(total, generator=g) * 2 - 0.5  # negative factors too
    return [x.to(DEVICE).requires_grad_(True) for x in (q, k, v)], scale.to(DEVICE)


@pytest.mark.parametrize("mask", ["causal", "sla", "fixed"])
def test_attn_scale_scales_each_row_forward_and_backward(mask):
    offs = offsets_from(LENGTHS).to(DEVICE)
    (q, k, v), scale = _inputs()
    nt = torch.tensor([min(5, L) for L in LENGTHS], device=DEVICE)
    margs = {
        "causal": dict(causal_closed_form=True),
        "sla": dict(func=masks.sla(offs, 20, 4)),
        "fixed": dict(num_targets=nt, window=10),
    }[mask]
    ref_kw = {"causal": {}, "sla": dict(attn_func=margs.get("func")), "fixed": dict(num_targets=nt, max_attn_len=10)}
    out = triton_hstu_mha(q, k, v, offs, alpha=0.3, out_scale=123.0, max_seq_len=70, attn_scale=scale, **margs)
    # The reference with scaling 1 gives silu(S) * M V; attn_scale multiplies output row t by scale[t].
    unscaled = flexhstu.hstu_mha(70, 0.3, q, k, v, offs, scaling_seqlen=1, kernel=Kernel.PYTORCH, **ref_kw[mask])
    ref = unscaled * scale[:, None, None]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda s: s.double(), "float64"),
        (lambda s: s[:-1], r"\(111,\)"),
        (lambda s: torch.stack([s, s], 1)[:, 0], "not contiguous"),
        (lambda s: s.clone().requires_grad_(True), "requires_grad=True"),
    ],
)
def test_a_bad_attn_scale_is_refused_by_name(bad, message):
    offs = offsets_from(LENGTHS).to(DEVICE)
    (q, k, v), scale = _inputs()
    with pytest.raises(ValueError, match=f"attn_scale: expected .*{message}"):
        triton_hstu_mha(
            q, k, v, offs, alpha=0.3, out_scale=1.0, max_seq_len=70, attn_scale=bad(scale), causal_closed_form=True
        )


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "scalar"])
def test_hstu_mha_attn_scale_on_triton_equals_the_reference(per_row):
    (q, k, v), scale = _inputs(seed=2)
    scale = scale if per_row else torch.tensor(0.7, device=DEVICE)
    offs = offsets_from(LENGTHS).to(DEVICE)
    kw = dict(attn_func=masks.sla(offs, 9, 3), attn_scale=scale)
    out = flexhstu.hstu_mha(70, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)
    ref = flexhstu.hstu_mha(70, None, q, k, v, offs, kernel=Kernel.PYTORCH, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
