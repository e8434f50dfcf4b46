"""The Triton kernels on CUDA: every mask family, bf16 and fp16, S up to 8192, a 131,072-token
sequence, total * H * D > 2^31, head dims 16..256 (powers of two or not, Dqk != Dv), and the
fixes of the CPU suite checked again on the GPU (strided offsets, max_seq_len, NaN confinement,
large fp16 inputs, IEEE fp32 dots).

Run on the GPU machine from the repository root (the package need not be installed):

    PYTHONPATH=$PWD python3 -m pytest tests/gpu -q -rA

Outputs are poisoned with NaN before every kernel (conftest.py). Each test prints one line with
its relative errors ``||x - ref|| / ||ref||``; the pass bound is ``TOL`` (1e-2) unless stated.
"""

from __future__ import annotations

import time

import pytest
import torch

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.jagged import offsets_from_lengths

TOL = 1e-2
"""Pass: ``||x - ref|| / ||ref|| <= TOL`` (bf16/fp16 kernels against a float32 reference) and no NaN."""


def offsets(lengths, dtype=torch.int64):
    return offsets_from_lengths(lengths, dtype=dtype, device="cuda")


def rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(name: str, errs: dict, tol: float = TOL) -> None:
    """Print one line for the log, then fail on any error above ``tol`` (NaN included)."""
    bad = [k for k, e in errs.items() if not e <= tol]
    print(f"\n{'FAIL' if bad else 'ok':4} {name:64} " + " ".join(f"{k}={e:.2e}" for k, e in errs.items()), flush=True)
    assert not bad, f"{name}: {', '.join(bad)} above {tol}: {errs}"


def mask_kwargs(name, offs, lengths, heads):
    total, n = sum(lengths), max(lengths)
    nt = torch.tensor([min(300, L) // 12 * 12 for L in lengths], device="cuda")
    if name == "causal":
        return {}
    if name == "fixed targets+ctx+window":
        return dict(num_targets=nt, contextual_seq_len=7, max_attn_len=1000)
    if name == "sla 256/32":
        return dict(attn_func=masks.sla(offs, 256, 32, total=total))
    if name == "sla 256/32 widened 5":
        return dict(attn_func=masks.sla(offs, 256, 32, total=total, nfunc=5))
    if name == "onerank":
        return dict(attn_func=masks.onerank(offs, nt, 12, total=total))
    if name == "random per-head 5":
        g = torch.Generator(device="cuda").manual_seed(3)
        func = torch.randint(-5, n + 5, (heads, 5, total), device="cuda", dtype=torch.int32, generator=g)
        return dict(attn_func=func)
    if name == "sla stride-0 expand":
        return dict(attn_func=masks.sla(offs, 100, 16, total=total, nheads=heads))
    raise KeyError(name)


def full_check(lengths, heads, dim, dtype, name, dim_v=None):
    """Output and dq/dk/dv of the kernels against the reference run in float32."""
    torch.manual_seed(0)
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    dim_v = dim_v or dim
    kw = mask_kwargs(name, offs, lengths, heads)
    q, k = (torch.randn(total, heads, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(total, heads, dim_v, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(total, heads, dim_v, device="cuda", dtype=dtype)
    out = flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref = flexhstu.hstu_mha(n, None, q32, k32, v32, offs, kernel=Kernel.PYTORCH, **kw)
    rgrads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    errs = {"out": rel(out, ref)}
    errs.update({w: rel(g, r) for w, g, r in zip(("dq", "dk", "dv"), grads, rgrads)})
    check(f"{name} Dqk{dim} Dv{dim_v} {str(dtype)[6:]} L={lengths}", errs)


ALL_MASKS = [
    "causal",
    "fixed targets+ctx+window",
    "sla 256/32",
    "sla 256/32 widened 5",
    "onerank",
    "random per-head 5",
    "sla stride-0 expand",
]


@pytest.mark.parametrize("name", ALL_MASKS)
def test_every_mask_bf16_d128_up_to_8192(name):
    full_check([8192, 0, 5013, 777], 2, 128, torch.bfloat16, name)


@pytest.mark.parametrize("name", ["causal", "sla 256/32", "onerank", "random per-head 5"])
def test_fp16_d64_jagged(name):
    full_check([3001, 4096, 1, 130], 2, 64, torch.float16, name)


def test_fixed_rule_fp16_d128():
    full_check([2048, 1500], 2, 128, torch.float16, "fixed targets+ctx+window")


DIMS = [  # (lengths, Dqk, Dv, dtype)
    ([2048, 777, 0], 256, 256, torch.bfloat16),
    ([1500, 33], 16, 16, torch.bfloat16),
    ([2048, 901], 64, 128, torch.bfloat16),
    ([2048, 901], 128, 32, torch.float16),
    ([1500, 333], 24, 24, torch.bfloat16),
    ([1500, 333], 48, 96, torch.bfloat16),
    ([1500, 333], 96, 96, torch.float16),
    ([1024, 333], 192, 192, torch.bfloat16),
]


@pytest.mark.parametrize("lengths,dqk,dv,dtype", DIMS, ids=[f"Dqk{d}-Dv{e}-{str(t)[6:]}" for _, d, e, t in DIMS])
@pytest.mark.parametrize("name", ["causal", "sla 256/32", "random per-head 5"])
def test_head_dims(lengths, dqk, dv, dtype, name):
    full_check(lengths, 2, dqk, dtype, name, dim_v=dv)


def _visible_rows(func, rows, cols, length):
    """bool (len(rows), len(cols)): func rows ``rows`` (global) against local key columns ``cols``."""
    f = func[0, :, rows].long()
    c = cols[None, :]
    vis = c < f[0][:, None]
    for j in range(1, (func.shape[1] + 1) // 2):
        vis |= (c >= f[2 * j - 1][:, None]) & (c < f[2 * j][:, None])
    return vis & (c < length)


def sampled_check(name, lengths, heads, dim, func_builder, causal_path=False):
    """Sampled rows (out, dq) and key columns (dk, dv) of the last sequence against a row-wise float32
    computation; and no NaN anywhere."""
    torch.manual_seed(0)
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    func = func_builder(offs, total)
    q, k, v = _qkv(lengths, heads, dim)
    dout = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    kw = {} if causal_path else {"attn_func": func}
    out = flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    L = lengths[-1]
    start = total - L
    alpha, scale = dim**-0.5, float(n)
    g = torch.Generator(device="cuda").manual_seed(1)
    local = (
        torch.cat(
            [
                torch.tensor([0, 1, 31, 32, 33, 255, 256, 257, L // 2, L - 2, L - 1], device="cuda"),
                torch.randint(0, L, (53,), device="cuda", generator=g),
            ]
        )
        .clamp(0, L - 1)
        .unique()
    )
    cols_all = torch.arange(L, device="cuda")
    Q, K, V, DO = (x.detach()[start : start + L].float() for x in (q, k, v, dout))
    ref_o, ref_dq, ref_dk, ref_dv = [], [], [], []
    for i in local.tolist():
        m = _visible_rows(func, torch.tensor([start + i], device="cuda"), cols_all, L)[0][None].float()
        s = torch.einsum("hd,jhd->hj", Q[i], K) * alpha
        sig = torch.sigmoid(s)
        ref_o.append(torch.einsum("hj,jhd->hd", s * sig * m, V) / scale)
        ds = torch.einsum("hd,jhd->hj", DO[i], V) * sig * (1 + s * (1 - sig)) * m
        ref_dq.append(torch.einsum("hj,jhd->hd", ds, K) * alpha / scale)
    rows_all = torch.arange(start, start + L, device="cuda")
    for j in local.tolist():
        m = _visible_rows(func, rows_all, torch.tensor([j], device="cuda"), L)[:, 0][None].float()
        s = torch.einsum("ihd,hd->hi", Q, K[j]) * alpha
        sig = torch.sigmoid(s)
        ref_dv.append(torch.einsum("hi,ihd->hd", s * sig * m, DO) / scale)
        ds = torch.einsum("ihd,hd->hi", DO, V[j]) * sig * (1 + s * (1 - sig)) * m
        ref_dk.append(torch.einsum("hi,ihd->hd", ds, Q) * alpha / scale)
    sel = start + local
    errs = {
        "out": rel(out[sel], torch.stack(ref_o)),
        "dq": rel(dq[sel], torch.stack(ref_dq)),
        "dk": rel(dk[sel], torch.stack(ref_dk)),
        "dv": rel(dv[sel], torch.stack(ref_dv)),
        "nan_anywhere": float("nan") if any(torch.isnan(x).any() for x in (out, dq, dk, dv)) else 0.0,
    }
    check(f"{name} total={total} H{heads} D{dim} ({elapsed:.1f}s)", errs)


def test_sla_131072_token_sequence():
    sampled_check("sla 131072-token sequence", [131072], 2, 128, lambda o, t: masks.sla(o, 256, 32, total=t))


def test_causal_131072_token_sequence():
    sampled_check(
        "causal 131072-token sequence", [131072], 1, 64, lambda o, t: masks.causal(o, total=t), causal_path=True
    )


def test_more_than_2_pow_31_elements():
    big = [4000] * 1100  # 4.4M rows * 4 heads * 128 = 2.25e9 elements > 2**31
    sampled_check("sla total*H*D > 2^31", big, 4, 128, lambda o, t: masks.sla(o, 256, 32, total=t))


def _qkv(lengths, heads, dim, dtype=torch.bfloat16, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    return [
        (scale * torch.randn(total, heads, dim, device="cuda", generator=g)).to(dtype).requires_grad_(True)
        for _ in range(3)
    ]


def _strided(x):
    return torch.stack([x, torch.full_like(x, -7)], 1)[:, 0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_strided_offsets_and_num_targets_give_the_contiguous_result(dtype):
    lengths = [3000, 0, 1025, 77]
    offs = offsets(lengths, dtype)
    nt = torch.tensor([120, 0, 24, 5], device="cuda", dtype=dtype)
    q, k, v = _qkv(lengths, 2, 64)
    dout = torch.randn_like(q)
    runs = []
    for o, t in ((offs, nt), (_strided(offs), _strided(nt))):
        out = flexhstu.hstu_mha(3000, None, q, k, v, o, num_targets=t, max_attn_len=300, kernel=Kernel.TRITON)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    errs = {w: float("nan") if not torch.equal(a, b) else 0.0 for w, a, b in zip(("out", "dq", "dk", "dv"), *runs)}
    check(f"strided {str(dtype)[6:]} offsets and num_targets == contiguous", errs, tol=0.0)


@pytest.mark.parametrize("max_seq_len", [0, 1, 500, 100_000])
def test_max_seq_len_is_only_a_hint(max_seq_len):
    from flexhstu.ops.triton import triton_hstu_mha

    lengths = [8192, 3001, 0, 64]
    offs = offsets(lengths)
    func = masks.sla(offs, 256, 32, total=sum(lengths))
    q, k, v = _qkv(lengths, 2, 128)
    dout = torch.randn_like(q)
    out = triton_hstu_mha(q, k, v, offs, func=func, alpha=128**-0.5, out_scale=1 / 8192, max_seq_len=max_seq_len)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref = flexhstu.hstu_mha(8192, None, q32, k32, v32, offs, attn_func=func, kernel=Kernel.PYTORCH)
    want = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    errs = {"out": rel(out, ref)}
    errs.update({w: rel(g, r) for w, g, r in zip(("dq", "dk", "dv"), got, want)})
    check(f"max_seq_len={max_seq_len} with sequences up to 8192", errs)


@pytest.mark.parametrize("name", ["causal", "fixed targets+ctx+window", "sla 256/32"])
def test_nan_in_one_sequence_never_reaches_another(name):
    lengths = [2000, 1500, 777]
    offs = offsets(lengths)
    kw = mask_kwargs(name, offs, lengths, 2)
    clean = _qkv(lengths, 2, 128)
    dout = torch.randn_like(clean[0])
    bad = slice(2000, 3500)
    dirty = [x.detach().clone() for x in clean]
    for x, value in zip(dirty, (float("nan"), float("inf"), float("nan"))):
        x[bad][::7] = value
    dirty = [x.requires_grad_(True) for x in dirty]
    dout_dirty = dout.clone()
    dout_dirty[bad][::5] = float("nan")
    runs = []
    for (q, k, v), do in ((clean, dout), (dirty, dout_dirty)):
        out = flexhstu.hstu_mha(2000, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    keep = torch.ones(sum(lengths), dtype=torch.bool, device="cuda")
    keep[bad] = False
    errs = {
        w: 0.0 if torch.equal(a[keep], b[keep]) else float("nan") for w, a, b in zip(("out", "dq", "dk", "dv"), *runs)
    }
    check(f"NaN/Inf in sequence 1 only ({name}): other sequences unchanged", errs, tol=0.0)


def _dense_fp32_causal(q, k, v, lengths, alpha, scale):
    """Float32 causal HSTU attention, one sequence at a time (an independent reference)."""
    outs, start = [], 0
    for L in lengths:
        qs, ks, vs = (x[start : start + L].float().transpose(0, 1) for x in (q, k, v))  # (H, L, D)
        s = alpha * qs @ ks.transpose(1, 2)
        keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        outs.append(((torch.nn.functional.silu(s) * keep) @ vs / scale).transpose(0, 1))
        start += L
    return torch.cat(outs)


def test_fp16_inputs_of_magnitude_100_stay_finite():
    # q and v of magnitude ~100 (k ~1): S ~ 1e2, silu(S) V ~ 1e4 per pair; the kernels keep S and the
    # accumulators in fp32, so the fp16 result stays finite and close to a float32 computation.
    lengths = [2048, 700]
    offs = offsets(lengths)
    q, _, v = _qkv(lengths, 2, 64, torch.float16, scale=100.0, seed=4)
    k = _qkv(lengths, 2, 64, torch.float16, seed=5)[0]
    dout = torch.randn_like(v)
    out = flexhstu.hstu_mha(2048, None, q, k, v, offs, kernel=Kernel.TRITON)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref = _dense_fp32_causal(q32, k32, v32, lengths, 64**-0.5, 2048.0)
    want = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    errs = {"out": rel(out, ref)}
    errs.update({w: rel(g, r) for w, g, r in zip(("dq", "dk", "dv"), got, want)})
    assert all(torch.isfinite(x).all() for x in (out, *got)), "non-finite fp16 output or gradient"
    check("fp16 q, v ~100: finite and close to a float32 reference", errs)


def test_fp32_dots_are_ieee_when_tf32_is_off():
    # TF32 products carry ~1e-3 relative error; IEEE fp32 dots stay near 1e-6.
    lengths = [1500, 333]
    offs = offsets(lengths)
    q, k, v = _qkv(lengths, 2, 64, torch.float32, seed=6)
    dout = torch.randn_like(v)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = flexhstu.hstu_mha(1500, None, q, k, v, offs, kernel=Kernel.TRITON)
        got = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
        ref = flexhstu.hstu_mha(1500, None, q64, k64, v64, offs, kernel=Kernel.PYTORCH)
        want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    errs = {"out": rel(out, ref)}
    errs.update({w: rel(g, r) for w, g, r in zip(("dq", "dk", "dv"), got, want)})
    check("fp32 with allow_tf32=False against float64", errs, tol=1e-4)


def _safe_reference(offs: torch.Tensor, total: int) -> torch.Tensor:
    """What ``safe_offsets`` must give, from torch ops: clamped, running maximum, 0 first, ``total`` last."""
    x = offs.clamp(0, total)
    x[0], x[-1] = 0, total
    return torch.cummax(x, 0).values


def test_safe_offsets_on_cuda_and_kernels_that_follow_them():
    # The kernels never follow the caller's offsets on CUDA (nothing reads them): one launch makes them safe.
    from flexhstu.ops.pytorch.delta_reference import pytorch_delta_hstu_mha
    from flexhstu.ops.triton.block_tables import safe_offsets
    from flexhstu.ops.triton.delta_op import triton_delta_hstu_mha

    g = torch.Generator(device="cuda").manual_seed(11)
    for n in (2, 5, 1024, 1025, 5000):  # one chunk, several chunks of the scan
        for total in (1, 777, 10**6):
            bad = torch.randint(-total, 2 * total, (n,), generator=g, device="cuda")
            assert torch.equal(safe_offsets(bad, total), _safe_reference(bad, total)), (n, total)
            good = torch.sort(torch.randint(0, total + 1, (n,), generator=g, device="cuda")).values
            good[0], good[-1] = 0, total
            assert torch.equal(safe_offsets(good, total), good), (n, total)
    total = 3000
    bad = torch.tensor([0, 1700, 900, 2400, 5000], device="cuda")  # decreasing, past the end
    safe = _safe_reference(bad, total)
    q, k, v = _qkv([total], 2, 64, torch.bfloat16, seed=12)
    out = flexhstu.hstu_mha(2000, None, q, k, v, bad, kernel=Kernel.TRITON)
    ref = flexhstu.hstu_mha(2000, None, q.float(), k.float(), v.float(), safe, kernel=Kernel.PYTORCH)
    errs = {"out": rel(out, ref)}
    q_offs = torch.tensor([0, 100, 50, 300, 9000], device="cuda")  # the delta call's query offsets, bad too
    q, k, v = (x.detach() for x in (q, k, v))  # the delta op is forward only
    got = triton_delta_hstu_mha(
        q[:300], k, v, bad, q_offs, torch.tensor([5, 0, 600, 0], device="cuda"), alpha=0.125, out_scale=1 / 2000
    )
    want = pytorch_delta_hstu_mha(
        q[:300].float(),
        k.float(),
        v.float(),
        safe,
        _safe_reference(q_offs, 300),
        torch.tensor([5, 0, 600, 0], device="cuda"),
        masks.rules.FixedRule(),
        alpha=0.125,
        scaling_seqlen=2000,
        max_seq_len=5000,
    )
    errs["delta"] = rel(got, want)
    check(f"bad offsets {bad.tolist()}: kernels follow the safe copy {safe.tolist()}", errs)
