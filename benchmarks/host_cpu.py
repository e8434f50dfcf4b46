"""An eager attention call's host time, measured on a machine without a GPU.

    PYTHONPATH=$PWD python benchmarks/host_cpu.py                    # host us per call, main configurations
    PYTHONPATH=$PWD python benchmarks/host_cpu.py --profile fwd+bwd  # and a cProfile of the call, by own time

The real entry point (``flexhstu.hstu_mha`` with a plan built once, forward and forward+backward) runs on CPU
tensors as it would on CUDA ones: the capability check is told the Triton backend may run, the value checks that
only CPU tensors get are skipped (``can_read_values``), Triton's driver is a stand-in (device 0, an sm_90 target),
and ``JITFunction._do_compile`` returns a stand-in compiled kernel whose launcher does nothing. So every Python
step of a launch runs (flexhstu's checks and arguments, ``fast_launch.Launcher``, Triton's binder and cache key,
or ``JITFunction.run`` on a first launch) and only the C launcher and the driver's launch do not. Use it to plan
host-time changes between device runs; the figures are this machine's, and ``benchmarks/host_profile.py`` is the
measurement on a GPU. Small tensors (one head of 16): the allocator's cost on the CPU is not the GPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
import types

import triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel

LAUNCHES: list[str] = []


class _Compiled(CompiledKernel):
    run = None  # a plain attribute here (CompiledKernel's is a property)

    def __init__(self, name: str):
        self.name, self.src, self.function, self.packed_metadata = name, None, 0, 0
        # Argument 6 is the launch metadata: None only when fast_launch.Launcher launched it.
        self.run = lambda *a: LAUNCHES.append("direct" if a[6] is None else "triton")

    def _init_handles(self):
        pass


def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    compiled = _Compiled(self.fn.__name__)
    self.device_caches[device][0][key] = compiled
    return compiled


_DRIVER = types.SimpleNamespace(
    active=types.SimpleNamespace(
        get_current_device=lambda: 0,
        get_current_stream=lambda device: 0,
        get_current_target=lambda: GPUTarget("cuda", 90, 32),
    )
)
jit.JITFunction._do_compile = _do_compile
jit.driver = _DRIVER

import host_profile  # noqa: E402  (beside this script: the same calls)
import torch  # noqa: E402

from flexhstu.ops.triton import fast_launch  # noqa: E402

fast_launch.driver = _DRIVER
sys.modules["flexhstu.ops.capability"].os = types.SimpleNamespace(environ={"TRITON_INTERPRET": "1"})
for _name, _module in list(sys.modules.items()):
    if _name.startswith("flexhstu") and hasattr(_module, "can_read_values"):
        _module.can_read_values = lambda x: False

CONFIGS = {
    "A causal B32 S1024": ([1024] * 32, "causal"),
    "W window 256 B4 S8192": ([8192] * 4, "window"),
    "S SLA 256/32 B4 S8192": ([8192] * 4, "sla"),
}


def calls(lengths: list[int], mask: str):
    """``host_profile.calls`` on the CPU, small tensors."""
    return host_profile.calls(lengths, mask, device="cpu", dtype=torch.float16, heads=1, dim=16)


def host_us(fn, runs: int, per_run: int) -> float:
    """The fastest of ``runs`` runs (this machine's other work only adds), the collector off."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(per_run):
                fn()
            times.append((time.perf_counter() - t0) / per_run * 1e6)
    finally:
        gc.enable()
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated configuration names (prefixes)")
    p.add_argument("--profile", choices=["fwd", "fwd+bwd"], help="also a cProfile of 300 calls, by own time")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--runs", type=int, default=11, help="timed runs (the fastest is shown)")
    p.add_argument("--per-run", type=int, default=300, help="calls per timed run")
    a = p.parse_args()
    names = [n for n in CONFIGS if not a.only or any(n.startswith(o.strip()) for o in a.only.split(","))]
    for name in names:
        fwd, fwd_bwd = calls(*CONFIGS[name])
        for _ in range(3):
            fwd_bwd()
        LAUNCHES.clear()
        fwd_bwd()
        launches = ", ".join(LAUNCHES)
        t_fwd, t_fwd_bwd = (host_us(fn, a.runs, a.per_run) for fn in (fwd, fwd_bwd))
        print(
            f"== {name}: host us per call: fwd {t_fwd:.1f}, fwd+bwd {t_fwd_bwd:.1f} "
            f"(launches of a fwd+bwd: {launches})",
            flush=True,
        )
        if a.profile:
            fn = fwd if a.profile == "fwd" else fwd_bwd
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fn()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
            print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
