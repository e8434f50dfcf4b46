"""Where an eager attention call's host time goes, with the plan built once outside the call (CUDA).

    PYTHONPATH=$PWD python3 benchmarks/host_profile.py [--top 25]

Per configuration: host microseconds per forward and per forward+backward call (the median of 7 runs of 50
calls each, no synchronisation inside a run: a call is launch-bound when this exceeds its device time), the
eager call's wall time as a user sees it (``triton.testing.do_bench`` of eager calls, median, host time
included where it exceeds the device's), then a cProfile of 50 calls of each, by own time (the Python functions
and the C calls they make: Triton's launcher, torch ops, the allocator); ``--no-profile`` skips it.

``--launches``: per kernel of the forward+backward, the host microseconds of one launch through Triton's
``kernel[grid](...)`` and through its parts: Triton's binder, its cache key, the compiled kernel's launcher
called directly (what ``flexhstu.ops.triton.fast_launch.Launcher`` does after the binder and the key).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.jagged import offsets_from_lengths
from flexhstu.ops.triton import fast_launch

CONFIGS = {
    "A causal B32 S1024": ([1024] * 32, "causal"),
    "C causal B4 S8192": ([8192] * 4, "causal"),
    "W window 256 B4 S8192": ([8192] * 4, "window"),
    "C SLA 256/32 B4 S8192": ([8192] * 4, "sla"),
}


def calls(lengths: list[int], mask: str, device="cuda", dtype=torch.bfloat16, heads: int = 4, dim: int = 128):
    """An eager forward and forward+backward of ``hstu_mha`` on the mask, with its plan built once."""
    offs = offsets_from_lengths(lengths, device=device)
    total, n = sum(lengths), max(lengths)
    kw = {
        "causal": {},
        "window": {"max_attn_len": 256},
        "sla": {"attn_func": masks.sla(offs, 256, 32, total=total)},
    }[mask]
    plan = flexhstu.build_plan(offs, total=total, max_seq_len=n, sparse=mask != "causal", **kw)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def fwd():
        return flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, attn_plan=plan, **kw)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (q, k, v), do)

    return fwd, fwd_bwd


def host_us(fn, runs: int = 7, per_run: int = 50) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(per_run):
            fn()
        times.append((time.perf_counter() - t0) / per_run * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def eager_ms(fn) -> float:
    return statistics.median(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="all"))


def launch_costs(fwd_bwd) -> None:
    """Host us of one launch of each kernel of ``fwd_bwd``, whole and in parts (see the module's docstring)."""
    seen = {}
    launch = fast_launch.Launcher.launch

    def recording(self, grid, **kwargs):
        seen.setdefault(self.kernel.fn.__name__, (self.kernel, grid, dict(kwargs)))
        return launch(self, grid, **kwargs)

    fast_launch.Launcher.launch = recording
    try:
        fwd_bwd()
    finally:
        fast_launch.Launcher.launch = launch
    torch.cuda.synchronize()
    for name, (kernel, grid, kwargs) in seen.items():
        costs = ", ".join(f"{label} {us:.1f}" for label, us in _launch_parts(kernel, grid, kwargs).items())
        print(f"   {name}: host us per launch: {costs}", flush=True)


def _launch_parts(kernel, grid: tuple, kwargs: dict) -> dict[str, float]:
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key

    device = driver.active.get_current_device()
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    full = dict(kwargs, debug=False, instrumentation_mode="")
    bound, spec, options = binder(**full)
    compiled = kernel_cache[compute_cache_key(key_cache, spec, options)]
    values = list(bound.values())
    grid3 = tuple(grid) + (1,) * (3 - len(grid))

    def direct():
        compiled.run(
            *grid3,
            driver.active.get_current_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *values,
        )

    parts = {
        "kernel[grid]": lambda: kernel[grid](**kwargs),
        "binder": lambda: binder(**full),
        "cache key": lambda: compute_cache_key(key_cache, spec, options),
        "launcher": direct,
    }
    return {label: host_us(fn) for label, fn in parts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--only", default="", help="comma-separated configuration names (prefixes)")
    p.add_argument("--no-profile", action="store_true", help="timings only, no cProfile")
    p.add_argument("--launches", action="store_true", help="each kernel's launch cost, whole and in parts")
    a = p.parse_args()
    names = [n for n in CONFIGS if not a.only or any(n.startswith(o.strip()) for o in a.only.split(","))]
    for name in names:
        fwd, fwd_bwd = calls(*CONFIGS[name])
        for fn in (fwd, fwd_bwd):
            for _ in range(5):
                fn()
        print(
            f"== {name}: host us per call: fwd {host_us(fwd):.1f}, fwd+bwd {host_us(fwd_bwd):.1f}; eager ms per "
            f"call: fwd {eager_ms(fwd):.4f}, fwd+bwd {eager_ms(fwd_bwd):.4f}",
            flush=True,
        )
        if a.launches:
            launch_costs(fwd_bwd)
        if a.no_profile:
            continue
        for label, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
            print(f"-- {name} {label}: cProfile of 50 calls, by own time\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
