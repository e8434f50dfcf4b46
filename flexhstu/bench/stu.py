"""Benchmark of the STU stack: forward + backward step time and peak memory, one row per layer variant.

A step is the stack's forward and the backward of ``out`` against a fixed gradient (every parameter
and the input get gradients). Time: median of ``triton.testing.do_bench`` after warm-up (the first
step, which compiles, is not timed). Memory: ``torch.cuda.max_memory_allocated`` over one step, less
what was allocated before it (inputs, parameters, mask), and the absolute peak.

Variants (``STULayerConfig`` fields): ``eager`` plain autograd; ``lean`` recompute; ``compiled`` the
plain body under torch.compile; ``lean+compiled`` recompute with compiled bodies; ``default`` the
config's defaults (on CUDA: lean+compiled).

    python -m flexhstu.bench.stu --suite               # causal, window 256, SLA 256/32, jagged
    python -m flexhstu.bench.stu --mask window --variants default eager --json out.json
    flexhstu bench --model-step --suite                # the same, through the command
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import masks
from ..cli.common import Parser
from ..jagged import offsets_from_lengths
from ..nn import STULayerConfig, STUStack
from .tables import STEP_HEADER, step_row

VARIANTS = {
    "eager": dict(recompute=False, compile=False),
    "lean": dict(recompute=True, compile=False),
    "compiled": dict(recompute=False, compile=True),
    "lean+compiled": dict(recompute=True, compile=True),
    "default": {},
}
SUITE = [("causal", "fixed"), ("window", "fixed"), ("sla", "fixed"), ("causal", "jagged")]


@dataclass
class StepRow:
    config: str
    variant: str
    step_ms: float
    step_peak_gib: float | None  # None off CUDA
    peak_gib: float | None
    total: int
    max_seq_len: int


def parse(argv=None) -> argparse.Namespace:
    p = Parser(prog="flexhstu bench --model-step", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512, help="embedding dim")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128, help="per head, for q, k, u and v")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096, help="sequence length for --lengths fixed")
    p.add_argument("--lengths", choices=["fixed", "jagged"], default="fixed",
                   help="fixed: --batch x --seq; jagged: --batch lengths uniform in [--jagged-min, --jagged-max]")
    p.add_argument("--jagged-min", type=int, default=512)
    p.add_argument("--jagged-max", type=int, default=8192)
    p.add_argument("--mask", choices=["causal", "window", "sla"], default="causal")
    p.add_argument("--window", type=int, default=256, help="max_attn_len for --mask window")
    p.add_argument("--sla-k1", type=int, default=256)
    p.add_argument("--sla-k2", type=int, default=32)
    p.add_argument("--suite", action="store_true", help="the four configurations: " + ", ".join(
        f"{m} {lg}" for m, lg in SUITE) + " (overrides --mask and --lengths)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (timed with CUDA events); cpu only checks the code path")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    for name in ("layers", "dim", "heads", "head_dim", "batch", "seq"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(a, name)}")
    if not 0 <= a.jagged_min <= a.jagged_max:
        p.error(f"--jagged-min, --jagged-max: expected 0 <= min <= max, got {a.jagged_min}, {a.jagged_max}")
    for name in ("window", "sla_k1", "sla_k2"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')}: expected an int >= 0, got {getattr(a, name)}")
    if not 0.0 <= a.dropout < 1.0:
        p.error(f"--dropout: expected a rate in [0, 1), got {a.dropout}")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        p.error(f"--device: expected cuda or cpu, got '{a.device}'")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device: expected cuda or cpu, got '{a.device}'")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device: expected cpu here (CUDA is not available; cpu runs the code path, untimed in any useful "
                "sense), got 'cuda'")
    if a.json:  # checked before the benchmark runs, not after
        out = Path(a.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            p.error(f"--json: expected a file that can be written, got '{a.json}'")
    return a


def lengths_of(a: argparse.Namespace, kind: str) -> list[int]:
    if kind == "fixed":
        return [a.seq] * a.batch
    g = torch.Generator().manual_seed(a.seed)
    return torch.randint(a.jagged_min, a.jagged_max + 1, (a.batch,), generator=g).tolist()


def mask_kwargs(a: argparse.Namespace, mask: str, offs: torch.Tensor) -> dict:
    """``STUStack`` keyword arguments for a mask: the fixed rule's, or a func (built once, as a model does)."""
    if mask == "causal":
        return {}
    if mask == "window":
        return {"max_attn_len": a.window}
    return {"attn_func": masks.sla(offs, a.sla_k1, a.sla_k2), "sparse": True}


def _timer(device: torch.device):
    if device.type == "cuda":
        import triton.testing

        return lambda fn, grads: triton.testing.do_bench(fn, grad_to_none=grads, return_mode="median")

    def cpu_median_ms(fn, grads, reps: int = 3):
        times = []
        for _ in range(reps):
            for t in grads:
                t.grad = None
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_median_ms


def _step(stack: STUStack, x, offs, max_len: int, kw: dict, grad_out) -> None:
    stack(x, offs, max_len, **kw).backward(grad_out)


def bench_config(a: argparse.Namespace, mask: str, kind: str, device: torch.device) -> Iterator[StepRow]:
    """One row per variant of ``a.variants`` for one mask and kind of lengths."""
    dtype = getattr(torch, a.dtype)
    lengths = lengths_of(a, kind)
    offs = offsets_from_lengths(lengths, device=device)
    total, max_len = sum(lengths), max(lengths)
    kw = mask_kwargs(a, mask, offs)
    gen = torch.Generator(device=device).manual_seed(a.seed)
    x = torch.randn(total, a.dim, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad_out = torch.randn(total, a.dim, device=device, dtype=dtype, generator=gen)
    timer = _timer(device)
    name = f"{mask} {kind} B{a.batch} " + (f"S{a.seq}" if kind == "fixed" else f"S{a.jagged_min}..{a.jagged_max}")
    for variant in a.variants:
        torch.manual_seed(a.seed)
        cfg = STULayerConfig(embedding_dim=a.dim, num_heads=a.heads, attention_dim=a.head_dim, hidden_dim=a.head_dim,
                             dropout=a.dropout, compile_backend=a.compile_backend, **VARIANTS[variant])
        stack = STUStack(cfg, a.layers).to(device=device, dtype=dtype)
        grads = [x, *stack.parameters()]
        step = functools.partial(_step, stack, x, offs, max_len, kw, grad_out)
        step()  # compiles where the variant compiles
        for t in grads:
            t.grad = None
        step_peak = peak = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            step_peak = peak - before / 2**30
        step_ms = timer(step, grads)
        del stack, grads, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield StepRow(name, variant, step_ms, step_peak, peak, total, max_len)


def main(argv=None) -> int:
    a = parse(argv)
    device = torch.device(a.device)
    configs = SUITE if a.suite else [(a.mask, a.lengths)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"STU stack: {a.layers} layers, dim {a.dim}, {a.heads} heads of {a.head_dim}, {a.dtype}, "
          f"dropout {a.dropout}, device {where}")
    print(STEP_HEADER)
    rows = []
    for mask, kind in configs:
        for row in bench_config(a, mask, kind, device):
            print(step_row(row), flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
