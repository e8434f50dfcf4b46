"""Tile sweep: per-kernel device time of each candidate tile set on the sparse and dense configurations.

    python benchmarks/sweep.py [--json PATH] [--warm-only] [--jobs N]

For every configuration and every tile set (forward, dQ, dK/dV tiles chosen together through
``tile_override``), one forward+backward is profiled (torch.profiler, five iterations after three
warm-ups) and each kernel's mean device time is printed, with the relative difference of the gradients
from those of the first tile set (a tile that computes something else shows there), so the tiles of
ops/triton/config.py can be chosen per kernel from data. ``--jobs N`` first compiles every variant in
N parallel processes (Triton's disk cache is shared), so the timing pass starts warm.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.jagged import offsets_from_lengths
from flexhstu.ops.triton.config import Tile, tile_override

# (forward, dq, dkdv) tiles: (BLOCK_M, BLOCK_N, warps, stages).
TILE_SETS = {
    "big": ((128, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 2)),
    "m64": ((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)),
    "m64s2": ((64, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 3)),
    "n32": ((128, 32, 8, 3), (128, 32, 8, 3), (32, 128, 8, 2)),
    "w8": ((128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 2)),
    "w8s3": ((128, 64, 8, 4), (128, 64, 8, 2), (64, 64, 8, 3)),
}

CONFIGS = {
    "C causal B4 S8192": ([8192] * 4, "causal"),
    "Cf causal func B4": ([8192] * 4, "causal-func"),
    "W window 256 B8": ([8192] * 8, "window"),
    "S3 SLA 256/32 B8": ([8192] * 8, "sla3"),
    "S5 SLA NFUNC5 B8": ([8192] * 8, "sla5"),
    "O OneRank B8": ([7424 + 768] * 8, "onerank"),
}


def mask_kwargs(kind: str, offs: torch.Tensor, lengths: list[int]) -> dict:
    total = sum(lengths)
    if kind == "causal":
        return {}
    if kind == "causal-func":
        return {"attn_func": masks.causal(offs, total=total)}
    if kind == "window":
        return {"max_attn_len": 256}
    if kind == "sla3":
        return {"attn_func": masks.sla(offs, 256, 32, total=total)}
    if kind == "sla5":
        return {"attn_func": masks.sla(offs, 256, 32, total=total, nfunc=5)}
    if kind == "onerank":
        nt = torch.full((len(lengths),), 768, device=offs.device)
        return {"attn_func": masks.onerank(offs, nt, 12, total=total)}
    raise KeyError(kind)


def setup(lengths, kind):
    torch.manual_seed(0)
    offs = offsets_from_lengths(lengths, device="cuda")
    total, n = sum(lengths), max(lengths)
    q, k, v = (torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    kw = mask_kwargs(kind, offs, lengths)

    def fb():
        out = flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)
        return torch.autograd.grad(out, (q, k, v), do)

    return fb


def override(tset):
    f, dq, kv = (Tile(*t) for t in TILE_SETS[tset])
    return tile_override(forward=f, dq=dq, dkdv=kv)


def _warm(jobs: list[tuple[str, str]]) -> None:
    for cname, tset in jobs:
        lengths, kind = CONFIGS[cname]
        try:
            with override(tset):
                setup(lengths, kind)()
            torch.cuda.synchronize()
        except Exception as e:  # reported in the timing pass
            print(f"warm {cname} {tset}: {type(e).__name__}: {str(e)[:120]}", flush=True)


def kernel_times(fb, iters=5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fb()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fb()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total <= 0:
            continue
        name = e.key
        for short in (
            "hstu_forward_kernel",
            "hstu_backward_dq_kernel",
            "hstu_backward_dkdv_kernel",
            "_plan_kernel",
            "_block_table_kernel",
        ):
            if short in name:
                name = short
                break
        else:
            name = "other"
        out[name] = out.get(name, 0.0) + e.device_time_total / iters
    return out


def graph_ms(fb) -> float:
    import triton

    from flexhstu.bench.timing import captured

    return triton.testing.do_bench(captured(fb), warmup=10, rep=40, return_mode="median")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--jobs", type=int, default=0)
    p.add_argument("--warm-only", action="store_true")
    p.add_argument("--only", default="", help="comma-separated config prefixes")
    p.add_argument("--tiles", default="", help="comma-separated tile-set names")
    a = p.parse_args()
    configs = [c for c in CONFIGS if not a.only or c.startswith(tuple(a.only.split(",")))]
    tsets = a.tiles.split(",") if a.tiles else list(TILE_SETS)
    pairs = [(c, t) for c in configs for t in tsets]
    if a.jobs > 0:
        t0 = time.perf_counter()
        chunks = [pairs[i :: a.jobs] for i in range(a.jobs)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_warm, args=(ch,)) for ch in chunks if ch]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        print(f"warm-up of {len(pairs)} variants in {a.jobs} processes: {time.perf_counter() - t0:.0f} s", flush=True)
    if a.warm_only:
        return 0
    rows = []
    first_grads: dict[str, tuple] = {}  # each configuration's gradients under the first tile set
    for cname, tset in pairs:
        lengths, kind = CONFIGS[cname]
        try:
            with override(tset):
                fb = setup(lengths, kind)
                t0 = time.perf_counter()
                fb()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                grads = fb()
                ref = first_grads.setdefault(cname, grads)
                err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(grads, ref))
                kt = kernel_times(fb)
                total = graph_ms(fb)
        except Exception as e:
            print(f"{cname:22} {tset:8} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        row = dict(config=cname, tiles=tset, first_s=first, graph_fb_ms=total, rel_err_vs_first_tiles=err, **kt)
        rows.append(row)
        print(
            f"{cname:22} {tset:8} graph fwd+bwd {total:7.3f} ms | fwd {kt.get('hstu_forward_kernel', 0):7.1f} "
            f"dq {kt.get('hstu_backward_dq_kernel', 0):7.1f} dkdv {kt.get('hstu_backward_dkdv_kernel', 0):7.1f} "
            f"plan {kt.get('_plan_kernel', 0):5.1f} tab {kt.get('_block_table_kernel', 0):5.1f} "
            f"other {kt.get('other', 0):6.1f} us | first {first:.1f} s | grads vs first tiles {err:.1e}",
            flush=True,
        )
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
