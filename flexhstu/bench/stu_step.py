"""Benchmark of the STU stack: forward + backward step time and peak memory, one row per layer variant.

A step is the stack's forward and the backward of ``out`` against a fixed gradient (every parameter
and the input get gradients). Time: median of ``triton.testing.do_bench`` after warm-up (the first
step, which compiles, is not timed). Memory, as users measure it: ``torch.cuda.max_memory_allocated``
after a reset over three steps in a row (the gradients of the input and the parameters kept and
accumulated between them, as a loop without ``zero_grad`` does), absolute: the input, its gradient, the
parameters and the mask included (*peak*); and that peak less what was allocated before the steps
(the input, the output's gradient, the parameters, the mask: *step peak*).

Variants (``STULayerConfig`` fields): ``eager`` plain autograd; ``lean`` recompute; ``compiled`` the
plain body under torch.compile; ``lean+compiled`` recompute with compiled bodies; ``default`` the
config's defaults (on CUDA: lean+compiled, u rebuilt in the backward); ``default+keep_u`` the defaults with u kept
for the backward (``recompute_u=False``).

Before it runs, the benchmark bounds the memory of its largest step from the sizes (``step_bytes``) and
refuses, naming the sizes to lower, what the device has no room for; while it runs, a line on stderr
says which step it is at.

    python -m flexhstu.bench.stu_step --suite          # causal, window 256, SLA 256/32, jagged
    python -m flexhstu.bench.stu_step --mask window --variants default eager --json out.json
    flexhstu bench --model-step --suite                # the same, through the command
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import masks
from ..cli.common import Parser
from ..jagged import offsets_from_lengths
from ..nn import STULayerConfig, STUStack
from .report import STEP_HEADER, step_row

VARIANTS = {
    "eager": dict(recompute=False, compile=False),
    "lean": dict(recompute=True, compile=False),
    "compiled": dict(recompute=False, compile=True),
    "lean+compiled": dict(recompute=True, compile=True),
    "default": {},
    "default+keep_u": dict(recompute_u=False),
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
    p.add_argument(
        "--lengths",
        choices=["fixed", "jagged"],
        default="fixed",
        help="fixed: --batch x --seq; jagged: --batch lengths uniform in [--jagged-min, --jagged-max]",
    )
    p.add_argument("--jagged-min", type=int, default=512)
    p.add_argument("--jagged-max", type=int, default=8192)
    p.add_argument("--mask", choices=["causal", "window", "sla"], default="causal")
    p.add_argument("--window", type=int, default=256, help="max_attn_len for --mask window")
    p.add_argument("--sla-k1", type=int, default=256)
    p.add_argument("--sla-k2", type=int, default=32)
    p.add_argument(
        "--suite",
        action="store_true",
        help="the four configurations: "
        + ", ".join(f"{m} {lg}" for m, lg in SUITE)
        + " (overrides --mask and --lengths)",
    )
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
        p.error(
            "--device: expected cpu here (CUDA is not available; cpu runs the code path, untimed in any useful "
            "sense), got 'cuda'"
        )
    if a.json:  # checked before the benchmark runs, not after
        out = Path(a.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            p.error(f"--json: expected a file that can be written, got '{a.json}'")
    need, have, worst = memory_check(a, device)
    if have is not None and need > have:
        length = "--seq" if worst == "fixed" else "--jagged-max"
        sizes = f"{length} {a.seq if worst == 'fixed' else a.jagged_max}"
        lower = f"--batch, {length}, " + ("--heads or --layers" if device.type == "cpu" else "--layers or --dim")
        p.error(
            f"--batch {a.batch} {sizes} --layers {a.layers} --dim {a.dim} --heads {a.heads} --head-dim "
            f"{a.head_dim} ({a.dtype}): a step needs up to {need / 2**30:.1f} GiB (estimate), "
            f"{have / 2**30:.1f} GiB available on {device.type}; lower {lower}"
        )
    return a


def configs_of(a: argparse.Namespace) -> list[tuple[str, str]]:
    """The (mask, lengths kind) pairs the run measures."""
    return SUITE if a.suite else [(a.mask, a.lengths)]


def step_bytes(
    *, layers: int, dim: int, heads: int, head_dim: int, lengths: list[int], itemsize: int, dense: bool
) -> int:
    """An upper bound of the memory (bytes) one step of the stack takes, inputs and parameters included.

    * rows: ``(layers + 1) * total * (6 * dim + 16 * heads * head_dim) * itemsize``. A plain layer keeps
      about ``3 dim + 11 heads head_dim`` values a row for its backward (x, LN(x), u v q k, a, LN(a),
      silu(u), y, the concatenation; the lean body less), and the backward adds gradients of the same
      shapes; measured on CUDA at the default sizes: 13.8 KB a row and layer, against the bound's 22 KB.
      The extra layer covers the inputs, the final norm and the gradients in flight.
    * parameters and their gradients: ``2 * layers * 7 * dim * heads * head_dim * itemsize``.
    * ``dense`` (the PyTorch reference attention, what runs on the CPU): it pads the batch to
      ``B x N`` (N the longest sequence) and works on ``(B, heads, N, N)`` scores in float32; autograd
      keeps about 10 bytes a score per layer (the scores, silu's input, the mask; 9-12 measured on the
      CPU) and a layer's forward or backward needs about 16 more at its peak: ``(12 * layers + 16) *
      B * heads * N**2``, plus the padded float32 q, k, v and output, ``16 * (layers + 1) * B * N *
      heads * head_dim``.
    """
    total, batch, n = sum(lengths), len(lengths), max(lengths, default=0)
    rows = (layers + 1) * total * (6 * dim + 16 * heads * head_dim) * itemsize
    weights = 2 * layers * 7 * dim * heads * head_dim * itemsize
    scores = (12 * layers + 16) * batch * heads * n * n + 16 * (layers + 1) * batch * n * heads * head_dim
    return rows + weights + (scores if dense else 0)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: ``torch.cuda.mem_get_info``'s free bytes on CUDA; on the CPU the kernel's
    MemAvailable (``/proc/meminfo``), else the physical memory; None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def memory_check(a: argparse.Namespace, device: torch.device) -> tuple[int, int | None, str]:
    """(the largest step's bound, the device's free memory or None, that step's kind of lengths)."""
    itemsize = torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    need = {
        kind: step_bytes(
            layers=a.layers,
            dim=a.dim,
            heads=a.heads,
            head_dim=a.head_dim,
            lengths=lengths_of(a, kind),
            itemsize=itemsize,
            dense=device.type == "cpu",
        )
        for kind in sorted({kind for _, kind in configs_of(a)})
    }
    worst = max(need, key=need.__getitem__)
    return need[worst], available_bytes(device), worst


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


def bench_config(
    a: argparse.Namespace, mask: str, kind: str, device: torch.device, say: Callable[[str], None] = lambda text: None
) -> Iterator[StepRow]:
    """One row per variant of ``a.variants`` for one mask and kind of lengths; ``say`` hears which step runs."""
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
        cfg = STULayerConfig(
            embedding_dim=a.dim,
            num_heads=a.heads,
            attention_dim=a.head_dim,
            hidden_dim=a.head_dim,
            dropout=a.dropout,
            compile_backend=a.compile_backend,
            **VARIANTS[variant],
        )
        stack = STUStack(cfg, a.layers).to(device=device, dtype=dtype)
        grads = [x, *stack.parameters()]
        step = functools.partial(_step, stack, x, offs, max_len, kw, grad_out)
        say(f"{name} {variant}: first step (compiles where the variant compiles)")
        step()
        for t in grads:
            t.grad = None
        step_peak = peak = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            for _ in range(3):  # the second and later steps add into gradients that already exist
                step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            step_peak = peak - before / 2**30
        say(f"{name} {variant}: timing")
        step_ms = timer(step, grads)
        del stack, grads, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield StepRow(name, variant, step_ms, step_peak, peak, total, max_len)


def main(argv=None) -> int:
    a = parse(argv)
    device = torch.device(a.device)
    configs = configs_of(a)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    need, have, _ = memory_check(a, device)
    print(
        f"STU stack: {a.layers} layers, dim {a.dim}, {a.heads} heads of {a.head_dim}, {a.dtype}, "
        f"dropout {a.dropout}, device {where}; a step needs up to {need / 2**30:.2f} GiB (estimate), "
        + ("available memory unknown" if have is None else f"{have / 2**30:.1f} GiB available")
    )
    print(STEP_HEADER, flush=True)
    rows: list[StepRow] = []
    steps, t_start = len(configs) * len(a.variants), time.perf_counter()

    def say(text: str) -> None:
        print(f"[{len(rows) + 1}/{steps}, {time.perf_counter() - t_start:.0f} s] {text}", file=sys.stderr, flush=True)

    for mask, kind in configs:
        for row in bench_config(a, mask, kind, device, say):
            print(step_row(row), flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
