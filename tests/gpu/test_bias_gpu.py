"""The relative attention bias in the Triton kernels on CUDA (from its tables, and dense: rab): bf16 and fp16
kernels against the float32 reference, output, dq, dk, dv and both tables' gradients (or rab's), every mask
family, S up to 8192.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_bias_gpu.py -q -rA

Outputs are poisoned with NaN before every kernel (conftest.py). Each test prints one line with its relative
errors ``||x - ref|| / ||ref||``; the pass bound is ``TOL`` (1e-2), the GPU suite's.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_gpu import check, mask_kwargs, offsets, rel

import flexhstu
from flexhstu import Kernel
from flexhstu.ops.bias import RelativeBias


def times(lengths, kind, seed=0):
    """int64 times per sequence: Unix seconds sorted (gaps 1 s .. 1 day, log-uniform) or random (one year), or
    ``wide``: random microseconds over 30 years, so 256-row chunks span more than 2^31 - 1 units (int64 path)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        if kind == "sorted":
            gaps = torch.exp(torch.rand(n, generator=g) * 11.4).to(torch.int64)
            out.append(1_600_000_000 + torch.cumsum(gaps, 0))
        elif kind == "wide":
            out.append(1_600_000_000_000_000 + torch.randint(0, 30 * 365 * 86400 * 10**6, (n,), generator=g))
        else:
            out.append(1_600_000_000 + torch.randint(0, 365 * 86400, (n,), generator=g))
    return torch.cat(out).cuda() if out else torch.zeros(0, dtype=torch.int64, device="cuda")


def bias_check(lengths, heads, dim, dtype, name, *, positions, per_head, kind="sorted"):
    torch.manual_seed(0)
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    kw = mask_kwargs(name, offs, lengths, heads)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, heads, dim, device="cuda", dtype=dtype)
    lead = (heads,) if per_head else ()
    pos_w = torch.randn(*lead, 2 * positions - 1, device="cuda").mul_(0.5).requires_grad_(True)
    ts_w = torch.randn(*lead, 129, device="cuda").mul_(0.5).requires_grad_(True)
    ts = times(lengths, kind)
    out = flexhstu.hstu_mha(n, None, q, k, v, offs, rel_bias=RelativeBias(pos_w, ts_w, ts), kernel=Kernel.TRITON, **kw)
    grads = torch.autograd.grad(out, (q, k, v, pos_w, ts_w), dout)
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    ref = flexhstu.hstu_mha(
        n, None, *leaves[:3], offs, rel_bias=RelativeBias(*leaves[3:], ts), kernel=Kernel.PYTORCH, **kw
    )
    rgrads = torch.autograd.grad(ref, leaves, dout.float())
    errs = {"out": rel(out, ref)}
    errs.update({w: rel(g, r) for w, g, r in zip(("dq", "dk", "dv", "dpos_w", "dts_w"), grads, rgrads)})
    check(f"bias {name} P={positions} {'per-head' if per_head else 'shared'} {kind} {str(dtype)[6:]} L={lengths}", errs)


@pytest.mark.parametrize("name", ["causal", "fixed targets+ctx+window", "sla 256/32", "onerank", "random per-head 5"])
def test_bias_every_mask_bf16_d128(name):
    bias_check([4096, 0, 2013, 777], 2, 128, torch.bfloat16, name, positions=4096, per_head=False)


@pytest.mark.parametrize("kind", ["sorted", "random", "wide"])
def test_bias_short_position_table_per_head_fp16(kind):
    # P = 300 is shorter than the sequences: relative positions beyond +-299 take the table's end entries.
    bias_check([3001, 1500, 1, 130], 2, 64, torch.float16, "sla 256/32", positions=300, per_head=True, kind=kind)


def test_bias_causal_b4_s8192_h4():
    bias_check([8192] * 4, 4, 128, torch.bfloat16, "causal", positions=8192, per_head=False)


@pytest.mark.parametrize("dim", [64, 256])
def test_bias_head_dims(dim):
    bias_check([2048, 901], 2, dim, torch.bfloat16, "causal", positions=2048, per_head=True)


@pytest.mark.parametrize("name", ["causal", "sla 256/32"])
def test_bias_times_wider_than_int32_bf16(name):
    # Every chunk spans ~10^15 units: the kernels' exact int64 time path on sm_90, against the reference.
    bias_check([3001, 0, 517, 1024], 2, 128, torch.bfloat16, name, positions=1024, per_head=False, kind="wide")


@pytest.mark.parametrize("name", ["causal", "sla 256/32", "random per-head 5"])
@pytest.mark.parametrize("shared", [False, True])
def test_dense_rab_in_the_kernels_matches_the_reference(name, shared):
    # bf16 q, k, v and rab; rab padded with NaN past each sequence (never read); N above the longest length.
    torch.manual_seed(0)
    lengths, heads, dim = [1000, 0, 517, 1536], 4, 128
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths) + 64
    kw = mask_kwargs(name, offs, lengths, heads)
    q, k, v = (
        torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    rab = torch.full((len(lengths), 1 if shared else heads, n, n), float("nan"), device="cuda")
    for b, length in enumerate(lengths):
        rab[b, :, :length, :length] = torch.randn(rab.shape[1], length, length, device="cuda") * 0.5
    rab = rab.bfloat16().requires_grad_(True)
    out = flexhstu.hstu_mha(n, None, q, k, v, offs, rab=rab, kernel=Kernel.TRITON, **kw)
    grads = torch.autograd.grad(out, (q, k, v, rab), dout)
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, rab)]
    ref = flexhstu.hstu_mha(n, None, *leaves[:3], offs, rab=leaves[3], kernel=Kernel.PYTORCH, **kw)
    rgrads = torch.autograd.grad(ref, leaves, dout.float())
    assert torch.isfinite(grads[3]).all()
    errs = {"out": rel(out, ref)}
    errs.update({w: rel(g, r) for w, g, r in zip(("dq", "dk", "dv", "drab"), grads, rgrads)})
    check(f"rab {name} {'shared' if shared else 'per-head'} bf16 L={lengths}", errs)
