"""A dense attention bias (``rab``) in the Triton kernels (flexhstu.ops.triton.rab_tiles) against the PyTorch
reference, forward and backward (q, k, v and rab), under TRITON_INTERPRET=1 on the CPU (or on a GPU).

The interpreter's blocks are small and unequal and its key-major split runs in chunks of two query blocks, so
these lengths cross many blocks and split ranges. Outputs and gradient buffers start as NaN (poisoned); the
padding of rab (pairs outside a sequence) is NaN too, so a kernel that read it would fail.
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
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
LENGTHS = [37, 0, 70, 16, 5]
HEADS = 2


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    with poison_outputs():
        yield


def mask_kwargs(name, offs, lengths):
    g = torch.Generator().manual_seed(3)
    if name == "causal":
        return {}
    if name == "fixed":  # targets, a window and a contextual prefix: the closed-form rule
        return dict(num_targets=torch.tensor([min(5, n) for n in lengths]), max_attn_len=10, contextual_seq_len=3)
    if name == "sla":
        return dict(attn_func=masks.sla(offs, 20, 4))
    if name == "random-per-head":
        return dict(
            attn_func=torch.randint(-3, max(lengths) + 3, (HEADS, 5, sum(lengths)), generator=g, dtype=torch.int32)
        )
    raise KeyError(name)


def make_rab(lengths, n, heads, dtype, seed=0):
    """``(B, heads, n, n)`` (``(B, n, n)`` for heads None): random inside each sequence, NaN outside it."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(lengths), n, n) if heads is None else (len(lengths), heads, n, n)
    rab = torch.full(shape, float("nan"), dtype=dtype)
    for b, length in enumerate(lengths):
        rab[b, ..., :length, :length] = torch.randn(*shape[1:-2], length, length, generator=g).to(dtype) * 0.8
    return rab.to(DEVICE).requires_grad_(True)


def run(kernel, q, k, v, offs, n, rab, dout, **kw):
    out = flexhstu.hstu_mha(n, 0.3, q, k, v, offs, rab=rab, kernel=kernel, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v, rab), dout))


def qkv_dout(lengths, seed, dtype=torch.float32):
    """q, k, v (requiring grad) and an output gradient, ``(total, HEADS, 16)``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(sum(lengths), HEADS, 16, generator=g).to(DEVICE, dtype) for _ in range(4))
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), dout


def compiled_equals_eager(call, inputs, dout, backend):
    """``torch.compile(call)`` (fullgraph) gives ``call``'s output and gradients of ``inputs``."""
    eager = call(*inputs)
    compiled = torch.compile(call, backend=backend, fullgraph=True)(*inputs)
    got = (compiled, *torch.autograd.grad(compiled, inputs, dout))
    for a, b in zip(got, (eager, *torch.autograd.grad(eager, inputs, dout))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def check(lengths, n, heads, mask, dtype=torch.float32, rab_dtype=torch.float32, **extra):
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v, dout = qkv_dout(lengths, 1, dtype)
    rab = make_rab(lengths, n, heads, rab_dtype)
    kw = {**mask_kwargs(mask, offs, lengths), **extra}
    got = run(Kernel.TRITON, q, k, v, offs, n, rab, dout, **kw)
    # The reference in float64: the kernels' float32 (or float16) against exact sums.
    want = run(
        Kernel.PYTORCH,
        *(x.detach().double().requires_grad_(True) for x in (q, k, v)),
        offs,
        n,
        rab.detach().double().requires_grad_(True),
        dout.double(),
        **kw,
    )
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("out", "dq", "dk", "dv", "drab"), got, want):
        assert a.dtype == (rab.dtype if name == "drab" else dtype), name
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(
            a.double(), b, rtol=tol, atol=tol * float(b.abs().max()), msg=lambda m, name=name: f"{name}: {m}"
        )
    return got


@pytest.mark.parametrize("mask", ["causal", "fixed", "sla", "random-per-head"])
@pytest.mark.parametrize("heads", [HEADS, 1, None])
def test_dense_bias_in_the_kernels_gives_the_reference_output_and_gradients(mask, heads):
    got = check(LENGTHS, max(LENGTHS), heads, mask)
    d_rab = got[4]
    assert d_rab.abs().sum() > 0
    # Pairs outside their sequence (the NaN padding) get no gradient.
    for b, length in enumerate(LENGTHS):
        inside = torch.zeros(d_rab.shape[-2:], dtype=torch.bool, device=d_rab.device)
        inside[:length, :length] = True
        assert (d_rab[b][..., ~inside] == 0).all()


def test_dense_bias_wider_than_the_longest_sequence_and_in_half_precision():
    # N = max_seq_len above every length: the rows and columns past a sequence are padding, never read.
    check(LENGTHS, max(LENGTHS) + 9, HEADS, "sla", dtype=torch.float16, rab_dtype=torch.float16)


def test_dense_bias_with_a_per_row_attention_scale():
    scale = torch.rand(sum(LENGTHS), generator=torch.Generator().manual_seed(4)).to(DEVICE) + 0.5
    check(LENGTHS, max(LENGTHS), HEADS, "causal", attn_scale=scale)


def test_dense_bias_changes_the_output():
    # Guards the tests above against a bias the kernels would ignore: the same call without it differs.
    offs = offsets_from(LENGTHS).to(DEVICE)
    q, k, v, _ = (x.detach() for x in qkv_dout(LENGTHS, 9))
    rab = make_rab(LENGTHS, max(LENGTHS), HEADS, torch.float32).detach()
    with_bias = flexhstu.hstu_mha(max(LENGTHS), 0.3, q, k, v, offs, rab=rab, kernel=Kernel.TRITON)
    without = flexhstu.hstu_mha(max(LENGTHS), 0.3, q, k, v, offs, kernel=Kernel.TRITON)
    assert not torch.allclose(with_bias, without, atol=1e-3)


def test_dense_bias_under_torch_compile_gives_the_eager_kernels_results():
    # Compiled, the call goes through the custom ops (their fakes, autograd and the rab gradient's flag).
    offs = offsets_from(LENGTHS).to(DEVICE)
    q, k, v, dout = qkv_dout(LENGTHS, 5)
    rab = make_rab(LENGTHS, max(LENGTHS), 1, torch.float32)
    func = masks.sla(offs, 20, 4)

    def call(q, k, v, rab):
        return flexhstu.hstu_mha(max(LENGTHS), 0.3, q, k, v, offs, attn_func=func, rab=rab, kernel=Kernel.TRITON)

    compiled_equals_eager(call, (q, k, v, rab), dout, "aot_eager")


def test_minus_infinity_in_rab_hides_a_pair_as_in_the_reference():
    # A -inf entry on a visible pair (a bias that hides it): silu at the floor is -0 with derivative 0, as the
    # reference floors every score; without the floor the kernels would give -inf * 0 = NaN, alpha <= 1 or not.
    lengths = [23, 9]
    offs = offsets_from(lengths).to(DEVICE)
    q, k, v, dout = qkv_dout(lengths, 6)
    rab = make_rab(lengths, max(lengths), HEADS, torch.float32).detach()
    rab[0, :, 5, 2] = float("-inf")
    rab[1, 1, 7, :7] = float("-inf")
    rab.requires_grad_(True)
    got = run(Kernel.TRITON, q, k, v, offs, max(lengths), rab, dout)
    want = run(Kernel.PYTORCH, q, k, v, offs, max(lengths), rab, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv", "drab"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3 * float(b.abs().max()))


def test_a_permuted_rab_under_inductor_gives_the_eager_results():
    # rab as a permuted view (dense, last stride 1, not contiguous), compiled by inductor through the custom ops.
    offs = offsets_from(LENGTHS).to(DEVICE)
    n = max(LENGTHS)
    q, k, v, dout = qkv_dout(LENGTHS, 7)
    base = (torch.randn(len(LENGTHS), n, HEADS, n, generator=torch.Generator().manual_seed(8)) * 0.5).to(DEVICE)

    def call(q, k, v, base):
        return flexhstu.hstu_mha(n, 0.3, q, k, v, offs, rab=base.permute(0, 2, 1, 3), kernel=Kernel.TRITON)

    compiled_equals_eager(call, (q, k, v, base.requires_grad_(True)), dout, "inductor")


def test_the_backward_ops_fake_gives_rab_gradient_the_real_ops_strides():
    # The real op returns a contiguous gradient (a float32 buffer cast) whatever rab's strides; a fake that
    # promised rab's own strides would fail the compiled graph's stride checks.
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flexhstu.ops.triton.op  # noqa: F401 (registers the ops)

    n, total = 8, 12
    with FakeTensorMode():
        q, k, v, dout = (torch.empty(total, HEADS, 16) for _ in range(4))
        rab = torch.empty(2, n, HEADS, n).permute(0, 2, 1, 3)
        offs = torch.tensor([0, 5, 12])
        outs = torch.ops.flexhstu.hstu_mha_bwd(
            dout, q, k, v, offs, None, None, None, 1, 0, 0, 0, False, 0.3, 1.0, n, None, None, None, False, rab, True
        )
    assert not rab.is_contiguous() and outs[5].shape == rab.shape and outs[5].is_contiguous()
