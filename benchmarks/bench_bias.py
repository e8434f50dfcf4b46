"""The relative attention bias in the Triton kernels: speed and memory with and without it (H200, bf16).

    PYTHONPATH=$PWD python benchmarks/bench_bias.py              # the two configurations of issue 14
    PYTHONPATH=$PWD python benchmarks/bench_bias.py --times random --json out.json

Configurations: causal B4 S8192 H4 D128, SLA (K1 256, K2 32) B4 S8192 H4 D128 under the plan an SLA model
builds (``build_plan(..., sparse=True)``, the sparse tiles; until 2026-12-07 the SLA rows ran under the dense
tiles of a call without a plan), and the fixed rule's window (``max_attn_len=256``) with its plan built once
(from 2026-12-07: the kernels of the fixed rule and of mask functions differ in the bias gradients). The bias is the STU
layer's (``flexhstu.nn.RelativeTimePositionBias``): one position table of ``2 S - 1`` entries and one table
of 129 time buckets, shared by the heads, both requiring grad. Timestamps (``--times``):

* ``sorted`` (default): each sequence's events in time order, gaps drawn log-uniformly from 1 s to 1 day
  (Unix seconds): near the diagonal a tile spans many buckets, away from it usually one;
* ``random``: times drawn uniformly from one year, in no order: every tile spans most buckets (the worst case
  of the per-tile bucket loop).

Every time is device time of a CUDA-graph replay (no host work), the median of ``--repeats`` medians of
``triton.testing.do_bench``; spread = (max - min) / median of the repeats. ``ratio`` is time without the
bias over time with it (1.0: free; the issue's target is at least 0.8 for forward+backward). Peak memory is
``torch.cuda.max_memory_allocated`` during one eager forward+backward, above what the inputs hold.
``--rab`` also times the same bias given dense (``rab``, ``(B, 1, S, S)`` bf16 made from the tables with
``dense_relative_bias``, its gradient in float32 in the kernels): what a caller that already holds a dense bias
gets, against the tables. Per-kernel device times (torch.profiler, eager calls) show where the bias's cost
goes. ``--tiles`` times the calls with the bias again under other tiles: each variant is
``KERNEL=M,N,WARPS,STAGES`` joined by ``+`` (kernels ``forward``, ``dq``, ``dkdv``), e.g.
``dkdv=32,64,4,2+forward=64,64,4,3``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def timestamps(lengths: list[int], kind: str, seed: int = 0) -> torch.Tensor:
    """int64 ``(total,)`` Unix-second times, per sequence, as ``--times`` says."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        start = 1_600_000_000 + int(torch.randint(0, 10**7, (1,), generator=g))
        if kind == "sorted":
            gaps = torch.exp(torch.rand(n, generator=g) * torch.log(torch.tensor(86400.0))).to(torch.int64)
            out.append(start + torch.cumsum(gaps, 0) - gaps[0])
        else:
            out.append(start + torch.randint(0, 365 * 86400, (n,), generator=g))
    return torch.cat(out)


def median_ms(fn, repeats: int) -> tuple[float, float]:
    import triton

    xs = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(repeats)]
    med = statistics.median(xs)
    return med, (max(xs) - min(xs)) / med


def kernel_times(fn) -> dict[str, float]:
    """Device microseconds per call of the eight longest kernels of ``fn`` (torch.profiler over 5 eager calls),
    then ``all N kernels``: the sum over every kernel and how many distinct ones ran."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            rows[e.key[:60]] = e.device_time_total / 5
    top = dict(sorted(rows.items(), key=lambda kv: -kv[1])[:8])
    top[f"all {len(rows)} kernels"] = sum(rows.values())
    return top


def run(name: str, mask: str, args) -> dict:
    from flexhstu import Kernel, hstu_mha, masks
    from flexhstu.bench.timing import captured
    from flexhstu.jagged import offsets_from_lengths
    from flexhstu.ops.bias import RelativeBias, dense_relative_bias
    from flexhstu.ops.plan import build_plan

    torch.manual_seed(0)
    lengths = [args.seq] * args.batch
    offs = offsets_from_lengths(lengths, device="cuda")
    total, n, h, d = sum(lengths), args.seq, args.heads, args.dim
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    kw = {}
    if mask == "sla":  # with the plan an SLA model builds for it (STUStack: sparse tiles where 4 (K1 + K2) <= S)
        func = masks.sla(offs, 256, 32, total=total)
        kw = {"attn_func": func, "attn_plan": build_plan(offs, total=total, max_seq_len=n, attn_func=func, sparse=True)}
    elif mask == "window":  # the fixed rule's window (max_attn_len), with the plan built once as a model would
        kw = {"max_attn_len": 256, "attn_plan": build_plan(offs, total=total, max_seq_len=n, max_attn_len=256)}
    pos_w = (torch.randn(2 * n - 1, device="cuda") * 0.02).requires_grad_(True)
    ts_w = (torch.randn(129, device="cuda") * 0.02).requires_grad_(True)
    bias = RelativeBias(pos_w, ts_w, timestamps(lengths, args.times).cuda())
    row = {"name": name, "times": args.times}
    runs = [("plain", {}, (q, k, v)), ("bias", {"rel_bias": bias}, (q, k, v, pos_w, ts_w))]
    if args.rab:
        with torch.no_grad():
            rab = dense_relative_bias(bias, offs, n).to(torch.bfloat16)
        rab.requires_grad_(True)
        runs.append(("rab", {"rab": rab}, (q, k, v, rab)))
    for label, extra, leaves in runs:

        def fwd(extra=extra):
            return hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, **extra, **kw)

        def fb(fwd=fwd, leaves=leaves):
            return torch.autograd.grad(fwd(), leaves, dout)

        fb()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fb()
        torch.cuda.synchronize()
        row[f"{label}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row[f"{label}_fwd_ms"], row[f"{label}_fwd_spread"] = median_ms(captured(fwd), args.repeats)
        row[f"{label}_fb_ms"], row[f"{label}_fb_spread"] = median_ms(captured(fb), args.repeats)
        if args.kernels:
            row[f"{label}_kernels_us"] = kernel_times(fb)
            row[f"{label}_fwd_kernels_us"] = kernel_times(fwd)
        if label == "bias":
            from flexhstu.ops.triton.config import Tile, tile_override

            for spec in args.tiles:
                chosen = {
                    part.split("=")[0]: Tile(*(int(x) for x in part.split("=")[1].split(",")))
                    for part in spec.split("+")
                }
                with tile_override(**chosen):
                    fb()
                    row[f"bias_fwd_ms [{spec}]"], _ = median_ms(captured(fwd), args.repeats)
                    row[f"bias_fb_ms [{spec}]"], _ = median_ms(captured(fb), args.repeats)
    row["fwd_ratio"] = row["plain_fwd_ms"] / row["bias_fwd_ms"]
    row["fb_ratio"] = row["plain_fb_ms"] / row["bias_fb_ms"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--times", choices=("sorted", "random"), default="sorted")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated name prefixes (causal, sla, window)")
    p.add_argument("--kernels", action="store_true", help="also per-kernel device times (torch.profiler)")
    p.add_argument(
        "--tiles",
        nargs="*",
        default=[],
        metavar="KERNEL=M,N,WARPS,STAGES[+...]",
        help="also time the calls with the bias under these tiles",
    )
    p.add_argument("--rab", action="store_true", help="also the bias as a dense (B, 1, S, S) rab")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    configs = [
        (f"causal B{args.batch} S{args.seq} H{args.heads} D{args.dim}", "causal"),
        (f"sla 256/32 B{args.batch} S{args.seq} H{args.heads} D{args.dim}", "sla"),
        (f"window 256 B{args.batch} S{args.seq} H{args.heads} D{args.dim}", "window"),
    ]
    if args.only:
        keep = tuple(x.strip() for x in args.only.split(","))
        configs = [c for c in configs if c[0].startswith(keep)]
    rows = []
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 | times {args.times}\n")
    print(
        "| config | fwd ms plain | fwd ms bias | fwd ratio | fwd+bwd ms plain | fwd+bwd ms bias | fwd+bwd ratio "
        "| spread (max) | peak MiB plain | peak MiB bias |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, mask in configs:
        r = run(name, mask, args)
        rows.append(r)
        spread = max(r[k] for k in r if k.endswith("_spread"))
        print(
            f"| {name} | {r['plain_fwd_ms']:.3f} | {r['bias_fwd_ms']:.3f} | {r['fwd_ratio']:.2f} "
            f"| {r['plain_fb_ms']:.3f} | {r['bias_fb_ms']:.3f} | {r['fb_ratio']:.2f} | {spread:.1%} "
            f"| {r['plain_peak_mib']:.0f} | {r['bias_peak_mib']:.0f} |",
            flush=True,
        )
        for spec in args.tiles:
            print(
                f"    tiles {spec}: with bias fwd {r[f'bias_fwd_ms [{spec}]']:.3f} ms "
                f"({r['plain_fwd_ms'] / r[f'bias_fwd_ms [{spec}]']:.2f}), fwd+bwd {r[f'bias_fb_ms [{spec}]']:.3f} ms "
                f"({r['plain_fb_ms'] / r[f'bias_fb_ms [{spec}]']:.2f})"
            )
        if args.rab:
            print(
                f"    dense rab: fwd {r['rab_fwd_ms']:.3f} ms ({r['plain_fwd_ms'] / r['rab_fwd_ms']:.2f}), fwd+bwd "
                f"{r['rab_fb_ms']:.3f} ms ({r['plain_fb_ms'] / r['rab_fb_ms']:.2f}), peak {r['rab_peak_mib']:.0f} MiB",
                flush=True,
            )
        if args.kernels:
            for label in ("plain", "bias", *(("rab",) if args.rab else ())):
                for part in ("fwd_kernels", "kernels"):
                    what = "forward" if part == "fwd_kernels" else "fwd+bwd"
                    times = ", ".join(f"{k} {us:.0f} us" for k, us in r[f"{label}_{part}_us"].items())
                    print(f"    {label} {what}: {times}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
