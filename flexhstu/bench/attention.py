"""Benchmark: hstu_mha (Triton) against FlexAttention and PyTorch SDPA (both softmax) on the same shapes.

Every time is the median of ``--repeats`` repeats, each a ``triton.testing.do_bench`` median (CUDA
events); the spread is ``(max - min) / median`` of the repeats. Two timings per call:

* *eager*: what a training loop sees without CUDA graphs (host work included when the GPU waits for it);
* *graph*: replay of the call captured in a CUDA graph, i.e. device time only. The efficiency
  figures use these, so host cost (reported apart) does not hide kernel time.

TFLOP/s count visible pairs exactly (``masks.count_visible``): forward ``4 * pairs * D``, forward +
backward ``14 * pairs * D``. SDPA runs causal on padded ``(B, H, S, D)`` and is credited with its
causal pairs. FlexAttention gets the same mask through a ``mask_mod`` (the causal rule in closed
form, else reading the func), its ``BlockMask`` built once outside the timed region, and
``torch.compile(flex_attention)`` (compile time outside the timed region). ``eff / C`` is a
configuration's effective TFLOP/s over causal C's in the same run. Each configuration builds its block plan
once (``flexhstu.build_plan``, as a model does per batch) and every timed call reuses it.

    flexhstu bench --suite                         # the configurations of benchmarks/RESULTS.md
    flexhstu bench --batch 8 --seq 4096 --mask sla --sla-k1 256 --sla-k2 32   # your own shape
    flexhstu bench --model-step --suite            # the STU stack's step (flexhstu/bench/stu_step.py)
    python -m flexhstu.bench.attention --suite     # the same as flexhstu bench --suite
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import Kernel, build_plan, hstu_mha, masks
from ..cli.common import Parser
from ..jagged import offsets_from_lengths
from .report import attention_table
from .timing import Timing, captured, median_of

MASKS = ("causal", "targets", "window", "sla", "onerank", "random")


@dataclass
class Case:
    name: str
    lengths: list[int]
    heads: int = 4
    dim: int = 128
    mask: str = "causal"  # one of MASKS
    nfunc: int | None = None  # widen the func to this width
    k1: int = 256
    k2: int = 32
    window: int = 0
    targets: int = 0
    group: int = 12
    density: float = 0.1  # random: expected fraction of a row's keys
    sdpa: bool = True
    flex: bool = True
    sparse: bool | None = None  # build_plan's tile hint (None: decided from the mask)


@dataclass
class Row:
    name: str
    nfunc: int
    pairs: int
    dim: int
    first_call_s: float = float("nan")
    ours: dict[str, Timing] = field(default_factory=dict)  # eager_fwd, eager_fb, graph_fwd, graph_fb
    sdpa: dict[str, Timing] = field(default_factory=dict)  # eager_fwd, eager_fb
    flex: dict[str, Timing] = field(default_factory=dict)  # eager_fwd, eager_fb
    sdpa_pairs: int = 0
    flex_compile_s: float = float("nan")

    def tflops(self, ms: float, fwd: bool, pairs: int | None = None) -> float:
        return (4 if fwd else 14) * (pairs or self.pairs) * self.dim / ms / 1e9


def suite() -> list[Case]:
    """The configurations of benchmarks/RESULTS.md. FlexAttention (compiled once per mask, ~30 s each) runs
    on the causal, window and SLA ones, where the issue's comparison is made."""
    s, w = [8192], 256
    return [
        Case("A causal B32 S1024", [1024] * 32, flex=False),
        Case("B causal B16 S2048 H8", [2048] * 16, heads=8, flex=False),
        Case("C causal B4 S8192", s * 4),
        Case("C targets 256", s * 4, mask="targets", targets=256, flex=False),
        Case("W window 256 B32", s * 32, mask="window", window=w),
        Case("W+T window 256 targets 256 B32", s * 32, mask="window", window=w, targets=256, flex=False),
        Case("S3 SLA 256/32 B32", s * 32, mask="sla", sparse=True),
        Case("S5 SLA 256/32 NFUNC5 B32", s * 32, mask="sla", nfunc=5, sparse=True),
        Case("O OneRank B16 7424+64x12", [7424 + 64 * 12] * 16, mask="onerank", targets=64 * 12, flex=False),
        Case("L SLA one seq 131072", [131072], mask="sla", sdpa=False, flex=False, sparse=True),
        Case("R random NFUNC5 per head 10% B8", s * 8, mask="random", nfunc=5, flex=False, sparse=True),
    ]


def random_func(offs: torch.Tensor, lengths: list[int], heads: int, density: float, seed: int = 0) -> torch.Tensor:
    """``(heads, 5, total)`` int32: per head and row, three intervals of random place and length that
    together cover about ``density`` of the row's keys (interval 0 starts at 0, as the format says)."""
    g = torch.Generator().manual_seed(seed)
    length = torch.cat([torch.full((n,), n) for n in lengths]).float()
    total = len(length)
    span = (2 * density / 3) * length  # each of three intervals: uniform length in [0, span), mean span / 2
    end0 = torch.rand(heads, total, generator=g) * span
    starts = torch.rand(heads, 2, total, generator=g) * length
    ends = starts + torch.rand(heads, 2, total, generator=g) * span
    rows = [end0, starts[:, 0], ends[:, 0], starts[:, 1], ends[:, 1]]
    return torch.stack(rows, 1).to(torch.int32).to(offs.device)


def mask_for(case: Case, offs: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """hstu_mha keyword arguments, and a func with the same visibility (counts pairs, feeds FlexAttention)."""
    total = sum(case.lengths)
    nt = torch.full((len(case.lengths),), case.targets, dtype=torch.int64, device=offs.device)
    targets = nt if case.targets else None
    if case.mask == "causal":
        return {}, masks.causal(offs, total=total)
    if case.mask in ("targets", "window"):
        kw = dict(num_targets=targets, max_attn_len=case.window)
        return kw, masks.fixed(offs, total=total, **kw)
    if case.mask == "sla":
        func = masks.sla(offs, case.k1, case.k2, total=total, nfunc=case.nfunc)
    elif case.mask == "onerank":
        func = masks.onerank(offs, nt, case.group, total=total)
    elif case.mask == "random":
        func = random_func(offs, case.lengths, case.heads, case.density)
    else:
        raise ValueError(f"mask: expected one of {MASKS}, got {case.mask!r}")
    return {"attn_func": func}, func


def _flex_mask_mod(case: Case, func: torch.Tensor, seq_len: int):
    if case.mask == "causal":
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    per_head = func.shape[0] > 1
    nint = (func.shape[1] + 1) // 2

    def mask_mod(b, h, q_idx, kv_idx):
        row = b * seq_len + q_idx
        f = func[h if per_head else 0]
        seen = kv_idx < f[0, row]
        for j in range(1, nint):
            seen = seen | ((kv_idx >= f[2 * j - 1, row]) & (kv_idx < f[2 * j, row]))
        return seen

    return mask_mod


def _flex(case: Case, func: torch.Tensor, dtype, timing: dict, row: Row) -> None:
    """FlexAttention (softmax) on the padded batch with the same mask; all sequences have one length."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, n, h, d = len(case.lengths), case.lengths[0], case.heads, case.dim
    block_mask = create_block_mask(
        _flex_mask_mod(case, func, n), b, h if func.shape[0] > 1 else None, n, n, device="cuda", _compile=True
    )  # compiled: no dense (B, H, N, N) mask
    compiled = torch.compile(flex_attention)
    qs, ks, vs = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    ds = torch.randn(b, h, n, d, device="cuda", dtype=dtype)

    def fwd():
        return compiled(qs, ks, vs, block_mask=block_mask)

    def fb():
        return torch.autograd.grad(fwd(), (qs, ks, vs), ds)

    t0 = time.perf_counter()
    fb()
    torch.cuda.synchronize()
    row.flex_compile_s = time.perf_counter() - t0
    row.flex = {"eager_fwd": timing(fwd), "eager_fb": timing(fb)}


def _sdpa(case: Case, dtype, timing: dict, row: Row) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, n, h, d = len(case.lengths), max(case.lengths), case.heads, case.dim
    qs, ks, vs = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    ds = torch.randn(b, h, n, d, device="cuda", dtype=dtype)

    def fwd():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    def fb():
        return torch.autograd.grad(fwd(), (qs, ks, vs), ds)

    row.sdpa_pairs = b * h * n * (n + 1) // 2
    row.sdpa = {"eager_fwd": timing(fwd), "eager_fb": timing(fb), "graph_fb": timing(captured(fb))}


def run_case(
    case: Case, *, repeats: int = 3, warmup: int = 10, rep: int = 40, flex: bool = True, dtype=torch.bfloat16
) -> Row:
    torch.manual_seed(0)
    offs = offsets_from_lengths(case.lengths, device="cuda")
    total, n, h, d = sum(case.lengths), max(case.lengths), case.heads, case.dim
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, h, d, device="cuda", dtype=dtype)
    kw, func = mask_for(case, offs)
    pairs = int(masks.count_visible(func, offs).sum()) * (h if func.shape[0] == 1 else 1)
    row = Row(case.name, func.shape[1], pairs, d)

    def timing(fn):
        return median_of(fn, repeats, warmup, rep)

    plan = build_plan(offs, total=total, max_seq_len=n, sparse=case.sparse, **kw)  # once per batch, as a model

    def fwd():
        return hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, attn_plan=plan, **kw)

    def fb():
        return torch.autograd.grad(fwd(), (q, k, v), dout)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fb()
    torch.cuda.synchronize()
    row.first_call_s = time.perf_counter() - t0
    row.ours = {
        "eager_fwd": timing(fwd),
        "eager_fb": timing(fb),
        "graph_fwd": timing(captured(fwd)),
        "graph_fb": timing(captured(fb)),
    }
    if case.sdpa:
        _sdpa(case, dtype, timing, row)
    if flex and case.flex:
        _flex(case, func, dtype, timing, row)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    if "--model-step" in argv:  # the STU benchmark parses its own options
        from . import stu_step

        argv.remove("--model-step")
        return stu_step.main(argv)
    p = Parser(prog="flexhstu bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-step",
        action="store_true",
        help="time the STU stack's forward+backward instead (options: flexhstu bench --model-step --help)",
    )
    p.add_argument("--suite", action="store_true", help="run the configurations recorded in benchmarks/RESULTS.md")
    p.add_argument("--only", default="", help="with --suite: comma-separated name prefixes to keep")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles per configuration)")
    p.add_argument("--repeats", type=int, default=3, help="do_bench medians per timing (their median is reported)")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--mask", default="causal", choices=MASKS)
    p.add_argument("--nfunc", type=int, default=None, help="widen the func to this width")
    p.add_argument("--sla-k1", type=int, default=256, help="sla: local causal window")
    p.add_argument("--sla-k2", type=int, default=32, help="sla: global prefix")
    p.add_argument("--window", type=int, default=256, help="max_attn_len of --mask window")
    p.add_argument("--targets", type=int, default=0)
    p.add_argument("--group-size", type=int, default=12)
    p.add_argument("--sparse", action="store_true", help="tell the block plan the mask is sparse (smaller tiles)")
    p.add_argument("--json", default="", help="also write the rows as JSON here (after every configuration)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats: expected at least 1, got {a.repeats}")
    if not torch.cuda.is_available():
        p.error("--suite / a custom shape: expected a CUDA GPU, found none (try --model-step --device cpu)")
    if a.suite:
        cases = suite()
        if a.only:
            keep = tuple(x.strip() for x in a.only.split(","))
            cases = [c for c in cases if c.name.startswith(keep)]
    else:
        cases = [
            Case(
                f"custom {a.mask}",
                [a.seq] * a.batch,
                heads=a.heads,
                dim=a.dim,
                mask=a.mask,
                nfunc=a.nfunc,
                k1=a.sla_k1,
                k2=a.sla_k2,
                window=a.window if a.mask == "window" else 0,
                targets=a.targets,
                group=a.group_size,
                sparse=True if a.sparse else None,
            )
        ]
    rows = []
    t_start = time.perf_counter()
    for c in cases:
        rows.append(run_case(c, repeats=a.repeats, warmup=a.warmup_ms, rep=a.rep_ms, flex=not a.no_flex))
        r = rows[-1]
        print(
            f"{c.name}: graph fwd {r.ours['graph_fwd'].ms:.3f} ms, fwd+bwd {r.ours['graph_fb'].ms:.3f} ms "
            f"({time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
        if a.json:
            with open(a.json, "w") as fh:
                json.dump([asdict(x) for x in rows], fh, indent=1)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16\n")
    print(attention_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
