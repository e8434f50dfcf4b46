"""Launching the hot-path kernels with less host work than ``kernel[grid](...)``.

An eager call of a small batch waits on the host: each of its launches (forward, dQ, dK/dV) goes through
Triton's ``JITFunction.run``, which besides binding and specialising the arguments builds launch metadata
and has the launcher call the (empty, in triton 3.6 never None) launch hooks. ``Launcher`` does what
``run`` does up to finding the compiled kernel, with Triton's own binder and cache key, so the kernel it
launches is the one Triton would launch, and then calls the compiled launcher directly, with no metadata and
no hooks. Where that is not the same thing (no compiled kernel yet, a launch hook or pre-run hook installed,
a changed global the kernel reads, a grid that is not a tuple, Triton's interpreter, ``JITFunction.run``
replaced by a tool that intercepts launches, as ``benchmarks/compile_check.py`` does), it calls
``kernel[grid](...)`` instead. Host time of one launch on an H100 machine (``benchmarks/host_profile.py
--launches``): the forward kernel's ``kernel[grid](...)`` 51 us, of which the binder 18, the cache key 2 and
the compiled launcher 14; the dK/dV kernel's 83, of which 28, 3 and 18.
"""

from __future__ import annotations

from triton import knobs
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction, compute_cache_key

_MISSING = object()
_TRITON_RUN = JITFunction.run  # what kernel[grid] calls; a tool that replaces it must see every launch


class Launcher:
    """``Launcher(kernel).launch(grid, **kwargs)`` does what ``kernel[grid](**kwargs)`` does (keyword
    arguments only: the call sites name every argument)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._jit = isinstance(kernel, JITFunction)

    def launch(self, grid: tuple, **kwargs) -> None:
        kernel = self.kernel
        rt = knobs.runtime
        if (
            not self._jit
            or JITFunction.run is not _TRITON_RUN
            or type(grid) is not tuple
            or not _no_hook(rt.launch_enter_hook)
            or not _no_hook(rt.launch_exit_hook)
            or kernel.pre_run_hooks
        ):
            kernel[grid](**kwargs)
            return
        # As JITFunction.run (triton 3.6): its two options, the device's caches, its binder and its cache key.
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or rt.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        device = driver.active.get_current_device()
        kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
        bound, specialization, options = binder(**kwargs)
        compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
        if compiled is None or hasattr(compiled, "result") or not _globals_unchanged(kernel):
            kernel[grid](**kwargs)  # compiles it, or raises Triton's error
            return
        run = compiled.run  # loads the binary on first use
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = driver.active.get_current_stream(device)
        run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound.values())


def _no_hook(hook) -> bool:
    """Whether a launch hook slot holds nothing to call: None (assigned) or an empty chain (triton 3.6's
    default); a function assigned to it, or a chain with hooks added (a profiler's), is something."""
    return hook is None or (type(hook) is HookChain and not hook.calls)


def _globals_unchanged(kernel: JITFunction) -> bool:
    """Whether every global the kernel read when compiled still has its value (``run`` raises otherwise)."""
    return not any(scope.get(name, _MISSING) != value for (name, _), (value, scope) in kernel.used_global_vals.items())
