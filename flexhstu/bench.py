"""Benchmark: hstu_mha (Triton) against PyTorch SDPA (softmax, flash) on the same shapes.

Times are medians of ``triton.testing.do_bench`` (CUDA events) after warm-up.
TFLOP/s count visible pairs exactly from the mask: forward ``4 * pairs * D``,
forward + backward ``14 * pairs * D``. SDPA runs causal on padded ``(B, H, S, D)``
and is credited with its causal pairs.

    flexhstu bench --suite                         # the configurations of RESULTS.md
    flexhstu bench --batch 8 --seq 4096 --mask sla --sla-k1 256 --sla-k2 32   # your own shape
    flexhstu bench --model-step --suite            # the STU stack's step (flexhstu/bench_stu.py)
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from . import Kernel, hstu_mha, masks
from .cli.common import Parser
from .jagged import offsets_from_lengths


@dataclass
class Case:
    name: str
    lengths: list[int]
    heads: int = 4
    dim: int = 128
    mask: str = "causal"  # causal | targets | sla | sla5 | onerank
    k1: int = 256
    k2: int = 32
    targets: int = 0
    group: int = 12
    memory: bool = False
    sdpa: bool = True
    graph: bool = True


@dataclass
class Row:
    name: str
    nfunc: int
    pairs: int
    first_call_s: float
    fwd_ms: float
    fwdbwd_ms: float
    fwd_tflops: float
    fwdbwd_tflops: float
    sdpa_fwd_ms: float = float("nan")
    sdpa_fwdbwd_ms: float = float("nan")
    sdpa_fwd_tflops: float = float("nan")
    sdpa_fwdbwd_tflops: float = float("nan")
    peak_mem_ratio: float = float("nan")
    graph_fwdbwd_ms: float = float("nan")
    sdpa_graph_fwdbwd_ms: float = float("nan")
    extra: dict = field(default_factory=dict)


def suite() -> list[Case]:
    g = torch.Generator().manual_seed(0)
    jag = torch.randint(256, 4097, (64,), generator=g).tolist()
    return [
        Case("A causal B32 S1024 H4", [1024] * 32),
        Case("B causal B16 S2048 H8", [2048] * 16, heads=8),
        Case("C causal B4 S8192 H4", [8192] * 4, memory=True),
        Case("C targets 256 (fixed)", [8192] * 4, mask="targets", targets=256),
        Case("C SLA 256/32 NFUNC3", [8192] * 4, mask="sla"),
        Case("C SLA 256/32 NFUNC5", [8192] * 4, mask="sla5"),
        Case("OneRank B4 7424+64x12", [7424 + 64 * 12] * 4, mask="onerank", targets=64 * 12),
        Case("J jagged B64 256..4096", jag, memory=True),
        Case("L SLA one seq 131072", [131072], mask="sla", sdpa=False),
    ]


def _mask_kwargs(case: Case, offs: torch.Tensor, total: int) -> tuple[dict, torch.Tensor]:
    """hstu_mha keyword arguments, and a func with the same visibility for counting pairs."""
    nt = torch.full((len(case.lengths),), case.targets, dtype=torch.int64, device=offs.device)
    if case.mask == "causal":
        return {}, masks.causal(offs, total=total)
    if case.mask == "targets":
        return {"num_targets": nt}, masks.fixed(offs, num_targets=nt, total=total)
    if case.mask in ("sla", "sla5"):
        func = masks.sla(offs, case.k1, case.k2, total=total, nfunc=5 if case.mask == "sla5" else None)
        return {"attn_func": func}, func
    if case.mask == "onerank":
        func = masks.onerank(offs, nt, case.group, total=total)
        return {"attn_func": func}, func
    raise ValueError(f"mask: expected causal, targets, sla, sla5 or onerank, got {case.mask}")


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graphed_ms(fn) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph (no host work per call); NaN if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return _bench(graph.replay)
    except Exception as e:  # reported as '-' in the table, with the reason on stdout
        print(f"  graph capture failed: {type(e).__name__}: {e}")
        return float("nan")


def run_case(case: Case, device: str = "cuda", dtype=torch.bfloat16) -> Row:
    torch.manual_seed(0)
    offs = offsets_from_lengths(case.lengths, device=device)
    total, n = sum(case.lengths), max(case.lengths)
    h, d = case.heads, case.dim
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, h, d, device=device, dtype=dtype)
    kw, func = _mask_kwargs(case, offs, total)
    pairs = int(masks.count_visible(func, offs)[0]) * h

    def fwd():
        return hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)

    def fwdbwd():
        return torch.autograd.grad(fwd(), (q, k, v), dout)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwdbwd()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    fwd_ms, fb_ms = _bench(fwd), _bench(fwdbwd)
    row = Row(case.name, func.shape[1], pairs, first, fwd_ms, fb_ms,
              4 * pairs * d / fwd_ms / 1e9, 14 * pairs * d / fb_ms / 1e9)
    if case.graph:
        row.graph_fwdbwd_ms = _graphed_ms(fwdbwd)
    if case.memory:
        # Peak over the forward+backward, with q, k, v, dout already allocated, against the bytes of
        # the eight tensors it must hold (q, k, v, out, dout, dq, dk, dv); everything else counts against us.
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        grads = fwdbwd()
        torch.cuda.synchronize()
        eight = 8 * q.numel() * q.element_size()
        row.peak_mem_ratio = torch.cuda.max_memory_allocated() / eight
        row.extra["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        del grads
    if case.sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b = len(case.lengths)
        qs, ks, vs = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        ds = torch.randn(b, h, n, d, device=device, dtype=dtype)
        sdpa_pairs = b * h * n * (n + 1) // 2

        def sfwd():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        def sfb():
            return torch.autograd.grad(sfwd(), (qs, ks, vs), ds)

        row.sdpa_fwd_ms, row.sdpa_fwdbwd_ms = _bench(sfwd), _bench(sfb)
        if case.graph:
            row.sdpa_graph_fwdbwd_ms = _graphed_ms(sfb)
        row.sdpa_fwd_tflops = 4 * sdpa_pairs * d / row.sdpa_fwd_ms / 1e9
        row.sdpa_fwdbwd_tflops = 14 * sdpa_pairs * d / row.sdpa_fwdbwd_ms / 1e9
    return row


def table(rows: list[Row]) -> str:
    head = ("| config | NFUNC | pairs (M) | first call s | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
            "| SDPA fwd ms | SDPA fwd+bwd ms | fwd / SDPA | fwd+bwd / SDPA | peak mem ratio |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        fr = r.sdpa_fwd_ms / r.fwd_ms if not math.isnan(r.sdpa_fwd_ms) else float("nan")
        br = r.sdpa_fwdbwd_ms / r.fwdbwd_ms if not math.isnan(r.sdpa_fwdbwd_ms) else float("nan")
        lines.append(
            f"| {r.name} | {r.nfunc} | {r.pairs / 1e6:.1f} | {r.first_call_s:.1f} "
            f"| {r.fwd_ms:.3f} | {r.fwd_tflops:.0f} "
            f"| {r.fwdbwd_ms:.3f} | {r.fwdbwd_tflops:.0f} | {r.sdpa_fwd_ms:.3f} | {r.sdpa_fwdbwd_ms:.3f} "
            f"| {fr:.2f} | {br:.2f} | {r.peak_mem_ratio:.2f} |"
        )
    graphed = [r for r in rows if not math.isnan(r.graph_fwdbwd_ms)]
    if graphed:
        lines += ["", "CUDA-graph replay of forward+backward (no host work per call):", "",
                  "| config | fwd+bwd ms (graph) | SDPA fwd+bwd ms (graph) | ratio |", "|---|---|---|---|"]
        for r in graphed:
            lines.append(f"| {r.name} | {r.graph_fwdbwd_ms:.3f} | {r.sdpa_graph_fwdbwd_ms:.3f} "
                         f"| {r.sdpa_graph_fwdbwd_ms / r.graph_fwdbwd_ms:.2f} |")
    return "\n".join(lines).replace("| nan ", "| - ")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else None
    if argv is not None and "--model-step" in argv:
        from . import bench_stu

        argv.remove("--model-step")
        return bench_stu.main(argv)
    p = Parser(prog="flexhstu bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-step", action="store_true",
                   help="time the STU stack's forward+backward instead (options: flexhstu bench --model-step --help)")
    p.add_argument("--suite", action="store_true", help="run the configurations recorded in benchmarks/RESULTS.md")
    p.add_argument("--only", default="", help="with --suite: comma-separated name prefixes to keep")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--mask", default="causal", choices=["causal", "targets", "sla", "sla5", "onerank"])
    p.add_argument("--sla-k1", type=int, default=256, help="sla: local causal window (default 256)")
    p.add_argument("--sla-k2", type=int, default=32, help="sla: global prefix (default 32)")
    p.add_argument("--targets", type=int, default=0)
    p.add_argument("--group-size", type=int, default=12)
    p.add_argument("--json", default="", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("--suite / a custom shape: expected a CUDA GPU, found none (try --model-step --device cpu)")
    if a.suite:
        cases = suite()
        if a.only:
            keep = tuple(x.strip() for x in a.only.split(","))
            cases = [c for c in cases if c.name.startswith(keep)]
    else:
        cases = [Case(f"custom {a.mask}", [a.seq] * a.batch, heads=a.heads, dim=a.dim, mask=a.mask, k1=a.sla_k1,
                      k2=a.sla_k2, targets=a.targets, group=a.group_size)]
    rows = []
    for c in cases:
        rows.append(run_case(c))
        print(f"{c.name}: fwd {rows[-1].fwd_ms:.3f} ms, fwd+bwd {rows[-1].fwdbwd_ms:.3f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16\n")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
