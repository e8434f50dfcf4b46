"""GPU correctness check of the Triton kernels, in one run: ``python benchmarks/gpu_check.py``.

* full comparisons (output, dq, dk, dv) against the reference in float32 on
  jagged batches up to S = 8192, D 64 and 128, bf16 and fp16, every mask family;
* a 131,072-token SLA sequence and a batch with ``total * H * D > 2**31``,
  checked on sampled rows (output, dq) and sampled key columns (dk, dv) against
  a row-wise float32 computation.

Outputs are poisoned with NaN before every kernel run, so an element no kernel
wrote fails. Pass: relative error ``||x - ref|| / ||ref|| <= 1e-2`` and no NaN.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import sys
import time

import torch

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.triton import op as triton_op

TOL = 1e-2
failures: list[str] = []


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device="cuda")


def rel(x, ref):
    x, ref = x.float(), ref.float()
    if torch.isnan(x).any():
        return float("nan")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def report(name, errs):
    bad = [k for k, e in errs.items() if not (e <= TOL)]
    status = "FAIL" if bad else "ok"
    if bad:
        failures.append(f"{name}: {', '.join(bad)}")
    print(f"{status:4} {name:58} " + " ".join(f"{k}={e:.2e}" for k, e in errs.items()), flush=True)


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
        return dict(attn_func=torch.randint(-5, n + 5, (heads, 5, total), device="cuda", dtype=torch.int32))
    if name == "sla stride-0 expand":
        return dict(attn_func=masks.sla(offs, 100, 16, total=total, nheads=heads))
    raise KeyError(name)


def full_check(lengths, heads, dim, dtype, names, dim_v=None):
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    dim_v = dim_v or dim
    for name in names:
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
        report(f"{name} Dqk{dim} Dv{dim_v} {str(dtype)[6:]} L={lengths}", errs)
        del ref, rgrads, q32, k32, v32
        torch.cuda.empty_cache()


def visible_rows(func, rows, cols, length):
    """bool (len(rows), len(cols)): func rows ``rows`` (global) against local key columns ``cols``."""
    f = func[0, :, rows].long()  # (NFUNC, R)
    c = cols[None, :]
    vis = c < f[0][:, None]
    for j in range(1, (func.shape[1] + 1) // 2):
        vis |= (c >= f[2 * j - 1][:, None]) & (c < f[2 * j][:, None])
    return vis & (c < length)


def sampled_check(name, lengths, heads, dim, func_builder, causal_path=False):
    """Row-wise float32 reference on sampled rows of the last sequence (largest offsets)."""
    offs = offsets(lengths)
    total, n = sum(lengths), max(lengths)
    func = func_builder(offs, total)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
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
    local = torch.cat([torch.tensor([0, 1, 31, 32, 33, 255, 256, 257, L // 2, L - 2, L - 1], device="cuda"),
                       torch.randint(0, L, (53,), device="cuda", generator=g)]).clamp(0, L - 1).unique()
    cols_all = torch.arange(L, device="cuda")
    Q, K, V, DO = (x.detach()[start:start + L].float() for x in (q, k, v, dout))
    ref_o, ref_dq, ref_dk, ref_dv = [], [], [], []
    for i in local.tolist():
        vis = visible_rows(func, torch.tensor([start + i], device="cuda"), cols_all, L)[0]
        s = torch.einsum("hd,jhd->hj", Q[i], K) * alpha
        sig = torch.sigmoid(s)
        m = vis[None].float()
        ref_o.append(torch.einsum("hj,jhd->hd", s * sig * m, V) / scale)
        ds = torch.einsum("hd,jhd->hj", DO[i], V) * sig * (1 + s * (1 - sig)) * m
        ref_dq.append(torch.einsum("hj,jhd->hd", ds, K) * alpha / scale)
    rows_all = torch.arange(start, start + L, device="cuda")
    for j in local.tolist():
        vis = visible_rows(func, rows_all, torch.tensor([j], device="cuda"), L)[:, 0]
        s = torch.einsum("ihd,hd->hi", Q, K[j]) * alpha
        sig = torch.sigmoid(s)
        m = vis[None].float()
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
    report(f"{name} total={total} H{heads} D{dim} ({elapsed:.1f}s)", errs)


def dims_check() -> None:
    """Head dims at the edges of the supported range, and Dqk != Dv."""
    names = ["causal", "sla 256/32", "random per-head 5"]
    full_check([2048, 777, 0], 2, 256, torch.bfloat16, names)
    full_check([1500, 33], 2, 16, torch.bfloat16, names)
    full_check([2048, 901], 2, 64, torch.bfloat16, names, dim_v=128)
    full_check([2048, 901], 2, 128, torch.float16, names, dim_v=32)


def main() -> int:
    triton_op.POISON_OUTPUTS = True
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    if "--dims" in sys.argv:
        dims_check()
        print(f"\n{len(failures)} failed" + "".join(f"\n  {f}" for f in failures))
        return 1 if failures else 0
    all_names = ["causal", "fixed targets+ctx+window", "sla 256/32", "sla 256/32 widened 5", "onerank",
                 "random per-head 5", "sla stride-0 expand"]
    full_check([8192, 0, 5013, 777], 2, 128, torch.bfloat16, all_names)
    full_check([3001, 4096, 1, 130], 2, 64, torch.float16, ["causal", "sla 256/32", "onerank", "random per-head 5"])
    full_check([2048, 1500], 2, 128, torch.float16, ["fixed targets+ctx+window"])
    sampled_check("sla 131072-token sequence", [131072], 2, 128, lambda o, t: masks.sla(o, 256, 32, total=t))
    sampled_check("causal 131072-token sequence", [131072], 1, 64, lambda o, t: masks.causal(o, total=t), causal_path=True)
    big = [4000] * 1100  # 4.4M rows * 4 heads * 128 = 2.25e9 elements > 2**31
    sampled_check("sla total*H*D > 2^31", big, 4, 128, lambda o, t: masks.sla(o, 256, 32, total=t))
    dims_check()
    print(f"\n{len(failures)} failed" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
