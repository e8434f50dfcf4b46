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

The binder and the cache key are skipped too once a call site has launched arguments of the same class: after
a launch that the binder specialised and found compiled, ``Launcher`` keeps (per device, the latest
``_SEEN``) a guard (``_guard``: a function generated for the kernel and that class, which checks exactly what
the binder's specialisation reads, and more) with the cache key and the compiled kernel it found. A launch the
guard accepts, whose compiled kernel is still the one Triton's cache holds under that key, is launched with it;
any other goes through the binder and the key as before. On this machine without a GPU
(``benchmarks/host_cpu.py``) that took 8 to 12 us off each launch (forward 15.7 to 7.8 us, dK/dV 24.2 to 11.2).
"""

from __future__ import annotations

import inspect

import torch
import triton
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
        self._seen: dict = {}  # device -> [(guard, cache key, compiled kernel)], the latest first (``_guard``)

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
        for guard, key, compiled in self._seen.get(device, ()):
            try:
                values = guard(**kwargs)
            except TypeError:  # an argument missing: the binder says so
                values = None
                break
            if values is not None and kernel_cache.get(key) is compiled:
                break
        else:
            values = None
        if values is None:
            bound, specialization, options = binder(**kwargs)
            key = compute_cache_key(key_cache, specialization, options)
            compiled = kernel_cache.get(key)
            if compiled is None or hasattr(compiled, "result"):
                kernel[grid](**kwargs)  # compiles it, or raises Triton's error
                return
            values = tuple(bound.values())
            guard = _guard(kernel, kwargs) if _GUARDED else None
            if guard is not None:  # a new list: another thread (autograd's) may be reading the old one
                self._seen[device] = [(guard, key, compiled), *self._seen.get(device, ())][:_SEEN]
        if not _globals_unchanged(kernel):
            kernel[grid](**kwargs)  # raises Triton's error
            return
        run = compiled.run  # loads the binary on first use
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = driver.active.get_current_stream(device)
        run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)


def _no_hook(hook) -> bool:
    """Whether a launch hook slot holds nothing to call: None (assigned) or an empty chain (triton 3.6's
    default); a function assigned to it, or a chain with hooks added (a profiler's), is something."""
    return hook is None or (type(hook) is HookChain and not hook.calls)


def _globals_unchanged(kernel: JITFunction) -> bool:
    """Whether every global the kernel read when compiled still has its value (``run`` raises otherwise)."""
    return not any(scope.get(name, _MISSING) != value for (name, _), (value, scope) in kernel.used_global_vals.items())


_SEEN = 8
_GUARDED = triton.__version__.startswith("3.6.")
"""Whether ``_guard`` knows this Triton's specialisation rules (read off triton 3.6's binder): under another
version every launch takes the binder, which costs time, never a wrong specialisation."""
"""Argument classes (guards) kept per launcher and device: a call site launches a handful at most."""
_PLAIN = (int, float, bool, str, type(None))
_NAMES = {"type", "len", "tuple", "int", "float", "options", "guard"}  # the guard's own names (and ``_...``)
_I32, _I64, _U64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1), (2**63, 2**64 - 1)


def _guard(kernel: JITFunction, kwargs: dict):
    """A function of the launch's keyword arguments that returns every argument in the kernel's order, as the
    binder's ``bound.values()``, when they are of the class of ``kwargs`` (a launch that the binder specialised
    and found compiled), and None otherwise; None when some argument is of a kind it does not handle.

    Of that class means: Triton's binder (``create_function_from_signature``, ``native_specialize_impl``, triton
    3.6) gives the same specialisation and options, so the cache key and the compiled kernel are the ones it
    finds: a constexpr or an option of the same type and equal value; a tensor (``torch.Tensor`` itself, no
    subclass) of the same dtype with its address 16-aligned or not alike; an int both 1, or both not 1 and alike
    in divisibility by 16 and in range (int32, int64 or uint64); a bool, a float, None; a tuple of the same type
    and length whose items are so. It checks more than the binder reads (alignment where a parameter is not
    specialised, the type of a non-constexpr float...), never less."""
    params = kernel.params
    sig = kernel.signature.parameters
    ns: dict = {"_Tensor": torch.Tensor}
    if any(name.startswith("_") or name in _NAMES for name in sig) or any(
        p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.values()
    ):
        return None  # a parameter would shadow a name the guard uses
    lines: list[str] = []
    conds: list[str] = []

    def const(value) -> str:
        name = f"_g{len(ns)}"
        ns[name] = value
        return name

    def plain(expr: str, value) -> bool:
        if type(value) not in _PLAIN:
            return False
        if value is None or type(value) is bool:
            conds.append(f"{expr} is {value}")  # singletons
        else:  # the same object (a value cached by the caller), else the same type and an equal value
            c = const(value)
            conds.append(f"({expr} is {c} or type({expr}) is {const(type(value))} and {expr} == {c})")
        return True

    def arg(expr: str, value) -> bool:
        t = type(value)
        if t is torch.Tensor:
            align = "== 0" if value.data_ptr() % 16 == 0 else "!= 0"
            dtype = const(value.dtype)
            conds.append(f"type({expr}) is _Tensor and {expr}.dtype is {dtype} and {expr}.data_ptr() & 15 {align}")
        elif t is int:
            if value == 1:
                conds.append(f"({expr} is {const(1)} or type({expr}) is int and {expr} == 1)")
                return True
            if _I32[0] <= value <= _I32[1]:
                rng = f"{_I32[0]} <= {expr} <= {_I32[1]}"
            elif _I64[0] <= value <= _I64[1]:
                rng = f"({_I64[0]} <= {expr} < {_I32[0]} or {_I32[1]} < {expr} <= {_I64[1]})"
            elif _U64[0] <= value <= _U64[1]:
                rng = f"{_U64[0]} <= {expr} <= {_U64[1]}"
            else:
                return False
            div = f"{expr} & 15 == 0" if value % 16 == 0 else f"{expr} & 15 != 0 and {expr} != 1"
            conds.append(f"({expr} is {const(value)} or type({expr}) is int and {rng} and {div})")
        elif t in (bool, float) or value is None:
            conds.append(f"{expr} is None" if value is None else f"type({expr}) is {t.__name__}")
        elif isinstance(value, tuple):
            conds.append(f"type({expr}) is {const(t)} and len({expr}) == {len(value)}")
            flush()
            items = [f"_{expr}_{i}" if expr[0] != "_" else f"{expr}_{i}" for i in range(len(value))]
            if items:
                lines.append(f"    {', '.join(items)}, = {expr}")
            return all(arg(item, v) for item, v in zip(items, value))
        else:
            return False
        return True

    def flush() -> None:
        if conds:
            lines.append(f"    if not ({' and '.join(conds)}):\n        return None")
            conds.clear()

    for kp, (name, p) in zip(params, sig.items()):
        value = kwargs.get(name, p.default)
        if value is inspect.Parameter.empty:
            return None
        if not (plain(name, value) if kp.is_constexpr else arg(name, value)):
            return None
    options = {k: v for k, v in kwargs.items() if k not in sig}
    conds.append(f"tuple(options) == {const(tuple(options))}")
    for k, v in options.items():
        if not plain(f"options[{k!r}]", v):
            return None
    flush()
    head = ", ".join(name if p.default is inspect.Parameter.empty else f"{name}={const(p.default)}"
                     for name, p in sig.items())
    body = "\n".join(lines)
    src = f"def guard({head}, **options):\n{body}\n    return ({', '.join(sig)},)\n"
    exec(src, ns)
    return ns["guard"]
