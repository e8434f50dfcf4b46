"""``fast_launch.Launcher`` against Triton's own ``JITFunction.run``, on the CPU: a real JITFunction, the
driver faked (device 0, an sm_90 target) and the compiler replaced by a recorder, so that both paths run
up to the launcher. A direct launch must pass the launcher what Triton's path passes (the same compiled
kernel, grid, stream and arguments), without the hooks; every other case must take Triton's path. The GPU
suite runs every kernel through it."""

from __future__ import annotations

import types
from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel

from flexhstu.ops.triton import fast_launch
from flexhstu.ops.triton.fast_launch import Launcher

SCALE = 3  # a global the kernel reads


def _kernel_fn(X, n, scale, ROWS: tl.constexpr, flag=None, COLS: tl.constexpr = 4):
    tl.static_assert(SCALE > 0)


class _Compiled(CompiledKernel):
    run = None  # a plain attribute here (CompiledKernel's is a property)

    def __init__(self, log, number):
        self.name, self.src, self.function, self.packed_metadata = "k", None, f"function {number}", "metadata"
        self.run = lambda *a: log.append(a)

    def _init_handles(self):
        pass


@pytest.fixture
def kernel(monkeypatch):
    fn = jit.JITFunction(_kernel_fn)
    launches, compiled = [], []

    def do_compile(key, signature, device, constexprs, options, attrs, warmup):
        c = _Compiled(launches, len(compiled))
        compiled.append((signature, constexprs, attrs))
        scope = globals()
        fn.used_global_vals[("SCALE", id(scope))] = (scope["SCALE"], scope)  # as Triton's compiler records it
        fn.device_caches[device][0][key] = c
        return c

    monkeypatch.setattr(fn, "_do_compile", do_compile)
    device = types.SimpleNamespace(
        get_current_device=lambda: 0,
        get_current_stream=lambda d: 77,
        get_current_target=lambda: GPUTarget("cuda", 90, 32),
    )
    fake = types.SimpleNamespace(active=device)
    monkeypatch.setattr(fast_launch, "driver", fake)
    monkeypatch.setattr(jit, "driver", fake)
    return types.SimpleNamespace(fn=fn, launches=launches, compiled=compiled)


def _direct(call) -> bool:
    return call[6:9] == (None, None, None)  # no metadata, no hooks: Launcher's own launch


def test_a_direct_launch_passes_what_tritons_launch_passes(kernel):
    x = torch.zeros(8)
    kw = dict(X=x, n=32, scale=0.5, ROWS=4, num_warps=4)
    Launcher(kernel.fn).launch((3, 2), **kw)  # compiles, through Triton
    Launcher(kernel.fn).launch((3, 2), **kw)
    kernel.fn[(3, 2)](**kw)
    assert len(kernel.compiled) == 1 and len(kernel.launches) == 3
    first, direct, by_triton = kernel.launches
    assert not _direct(first) and _direct(direct) and not _direct(by_triton)
    assert direct[:6] == by_triton[:6] == (3, 2, 1, 77, "function 0", "metadata")
    assert len(direct) == len(by_triton)
    assert all(a is b for a, b in zip(direct[9:], by_triton[9:]))


@pytest.mark.parametrize(
    "change",
    [
        {"ROWS": 8},  # a constexpr
        {"num_warps": 8},  # a launch option
        {"n": 33},  # an int's divisibility
        {"n": 1},  # Triton makes 1 a constant
        {"X": torch.zeros(9)[1:]},  # a tensor's alignment
        {"X": torch.zeros(8, dtype=torch.float16)},  # a tensor's dtype
        {"flag": 3},  # a default replaced
    ],
)
def test_another_specialisation_is_compiled_by_triton_then_launched_directly(kernel, change):
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4, num_warps=4)
    launcher = Launcher(kernel.fn)
    launcher.launch((1,), **kw)
    launcher.launch((1,), **{**kw, **change})
    assert len(kernel.compiled) == 2 and not any(_direct(c) for c in kernel.launches)
    launcher.launch((1,), **{**kw, **change})
    assert len(kernel.compiled) == 2 and _direct(kernel.launches[-1])
    assert kernel.launches[-1][4] == "function 1"


def test_other_values_of_one_specialisation_launch_directly(kernel):
    launcher = Launcher(kernel.fn)
    launcher.launch((1,), X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    y = torch.ones(4)
    launcher.launch((5,), X=y, n=48, scale=2.0, ROWS=4)
    assert len(kernel.compiled) == 1 and _direct(kernel.launches[-1])
    args = kernel.launches[-1][9:]
    assert args[0] is y and args[1:4] == (48, 2.0, 4) and args[4] is None and args[5] == 4


def test_hooks_a_changed_global_and_other_grids_take_tritons_path(kernel, monkeypatch):
    launcher = Launcher(kernel.fn)
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    launcher.launch((1,), **kw)

    def hook(metadata):
        pass

    fast_launch.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher.launch((1,), **kw)
    finally:
        fast_launch.knobs.runtime.launch_enter_hook.remove(hook)
    kernel.fn.pre_run_hooks.append(lambda *a, **k: None)
    try:
        launcher.launch((1,), **kw)
    finally:
        kernel.fn.pre_run_hooks.clear()
    launcher.launch([1], **kw)
    assert len(kernel.launches) == 4 and not any(_direct(c) for c in kernel.launches)
    launcher.launch((1,), **kw)
    assert _direct(kernel.launches[-1])
    monkeypatch.setitem(globals(), "SCALE", 4)
    with pytest.raises(RuntimeError, match="SCALE"):
        launcher.launch((1,), **kw)


def test_the_interpreters_kernels_are_launched_as_given():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda **kw: calls.append((grid, kw))

    Launcher(Interpreted()).launch((2, 1), A=1)
    Launcher(Interpreted()).launch((2, 1), A=1)
    assert calls == [((2, 1), {"A": 1}), ((2, 1), {"A": 1})]


@pytest.mark.parametrize("slot", ["launch_enter_hook", "launch_exit_hook"])
def test_a_hook_assigned_rather_than_added(kernel, monkeypatch, slot):
    # triton 3.6 keeps a chain in each slot, but a user may assign None (no hook: launched directly) or a function
    # (a hook: Triton's path, which calls it).
    launcher = Launcher(kernel.fn)
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    launcher.launch((1,), **kw)
    monkeypatch.setattr(fast_launch.knobs.runtime, slot, None)
    launcher.launch((1,), **kw)
    assert _direct(kernel.launches[-1])
    monkeypatch.setattr(fast_launch.knobs.runtime, slot, lambda metadata: None)
    launcher.launch((1,), **kw)
    assert not _direct(kernel.launches[-1])


def test_a_replaced_run_sees_every_launch(kernel, monkeypatch):
    # A tool that intercepts launches by replacing JITFunction.run (benchmarks/compile_check.py compiles for sm_90
    # instead of launching) must get every launch, warm ones included, before the driver is asked for anything.
    launcher = Launcher(kernel.fn)
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    launcher.launch((1,), **kw)
    seen = []
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, grid, warmup, **k: seen.append((grid, k["n"])))
    monkeypatch.setattr(fast_launch, "driver", None)  # asking it would fail, as on a machine without a GPU
    launcher.launch((2,), **kw)
    assert seen == [((2,), 32)] and len(kernel.launches) == 1


# The guard (``fast_launch._guard``): a launch whose arguments it accepts skips Triton's binder and cache key, so
# acceptance must imply the binder's specialisation and options; these compare the two on varied arguments.


class _Pair(NamedTuple):
    ptr: torch.Tensor
    stride: int


def _tuple_kernel_fn(X, P, n, T, scale, ROWS: tl.constexpr, MODE: tl.constexpr = "a", flag=None):
    pass


def _binder(fn):
    return fn.device_caches[0][4]


def _spec(fn, kw):
    _, specialization, options = _binder(fn)(**kw)
    return specialization, options


_BASE = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4, debug=False, instrumentation_mode="")


def _variants():
    """(name, change, same class as _BASE)."""
    x = torch.zeros(40)
    return [
        ("same values", {}, True),
        ("another tensor", {"X": torch.ones(8)}, True),
        ("an aligned view", {"X": x[4:]}, True),
        ("a misaligned view", {"X": x[1:]}, False),
        ("another dtype", {"X": torch.zeros(8, dtype=torch.float16)}, False),
        ("an int dtype", {"X": torch.zeros(8, dtype=torch.int32)}, False),
        ("a tensor subclass", {"X": torch.nn.Parameter(torch.zeros(8))}, False),
        ("another multiple of 16", {"n": 48}, True),
        ("zero", {"n": 0}, True),
        ("a negative multiple of 16", {"n": -16}, True),
        ("not a multiple of 16", {"n": 33}, False),
        ("one", {"n": 1}, False),
        ("True for an int", {"n": True}, False),
        ("a float for an int", {"n": 32.0}, False),
        ("None for an int", {"n": None}, False),
        ("int64 multiple of 16", {"n": 2**32}, False),
        ("int32 edge", {"n": -(2**31)}, True),
        ("just past int32", {"n": 2**31}, False),
        ("uint64", {"n": 2**63}, False),
        ("another float", {"scale": 3.0}, True),
        ("an int for a float", {"scale": 3}, False),
        ("a changed constexpr", {"ROWS": 8}, False),
        ("a float constexpr equal to it", {"ROWS": 4.0}, False),
        ("a launch option", {"num_warps": 8}, False),
        ("debug", {"debug": True}, False),
        ("a default replaced", {"flag": 3}, False),
        ("an unknown keyword", {"bogus": 1}, False),
    ]


@pytest.mark.parametrize("name,change,same", _variants(), ids=[v[0] for v in _variants()])
def test_the_guard_accepts_exactly_the_binders_class(kernel, name, change, same):
    fn = kernel.fn
    guard = fast_launch._guard(fn, _BASE)
    assert guard is not None
    kw = {**_BASE, **change}
    values = guard(**kw)
    assert (values is not None) == same
    if values is not None:
        assert _spec(fn, kw) == _spec(fn, _BASE)
        bound = _binder(fn)(**kw)[0]
        assert len(values) == len(bound) and all(a is b for a, b in zip(values, bound.values()))
    else:
        try:
            other = _spec(fn, kw)
        except (TypeError, OverflowError):
            return
        if name not in ("a tensor subclass", "a float constexpr equal to it"):  # stricter than the binder there
            assert other != _spec(fn, _BASE)


@pytest.mark.parametrize(
    "change,same",
    [
        ({}, True),
        ({"P": _Pair(torch.zeros(4), 16)}, True),
        ({"P": _Pair(torch.zeros(5)[1:], 16)}, False),
        ({"P": _Pair(torch.zeros(4), 17)}, False),
        ({"P": _Pair(torch.zeros(4), 1)}, False),
        ({"P": (torch.zeros(4), 16)}, None),  # a plain tuple: the binder's key equals, the guard wants the type
        ({"T": (3, 16, 1)}, True),
        ({"T": (3, 16)}, False),
        ({"T": (3, 16, 2)}, False),
        ({"T": (1, 16, 1)}, False),
        ({"T": (3, 2**40, 1)}, False),
        ({"MODE": "b"}, False),
        ({"MODE": "a" * 1}, True),
    ],
)
def test_the_guard_on_tuples_and_string_constexprs(kernel, change, same):
    fn = jit.JITFunction(_tuple_kernel_fn)
    base = dict(
        X=torch.zeros(8),
        P=_Pair(torch.ones(4), 32),
        n=5,
        T=(7, 32, 1),
        scale=1.0,
        ROWS=2,
        debug=False,
        instrumentation_mode="",
    )
    guard = fast_launch._guard(fn, base)
    kw = {**base, **change}
    values = guard(**kw)
    assert (values is not None) == bool(same)
    assert (_spec(fn, kw) == _spec(fn, base)) == (same is not False)
    if values is not None:
        assert all(a is b for a, b in zip(values, _binder(fn)(**kw)[0].values()))


def test_the_guard_keeps_no_tensor_alive(kernel):
    x = torch.zeros(8)
    guard = fast_launch._guard(kernel.fn, {**_BASE, "X": x})
    assert not any(v is x for v in guard.__globals__.values())
    assert not any(isinstance(v, torch.Tensor) for v in guard.__globals__.values())


def test_two_classes_at_one_call_site_both_launch_directly(kernel):
    launcher = Launcher(kernel.fn)
    a = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    b = dict(a, n=33)
    for kw in (a, b, a, b, a, b):
        launcher.launch((1,), **kw)
    assert len(kernel.compiled) == 2
    assert [_direct(c) for c in kernel.launches] == [False, False, True, True, True, True]
    assert [c[4] for c in kernel.launches[2:]] == ["function 0", "function 1"] * 2
    assert [c[10] for c in kernel.launches] == [32, 33] * 3


def test_a_kernel_dropped_from_tritons_cache_is_not_launched(kernel):
    launcher = Launcher(kernel.fn)
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    launcher.launch((1,), **kw)
    launcher.launch((1,), **kw)
    assert _direct(kernel.launches[-1]) and kernel.launches[-1][4] == "function 0"
    kernel.fn.device_caches[0][0].clear()
    launcher.launch((1,), **kw)  # compiled again, by Triton
    assert len(kernel.compiled) == 2 and not _direct(kernel.launches[-1])
    launcher.launch((1,), **kw)
    assert _direct(kernel.launches[-1]) and kernel.launches[-1][4] == "function 1"


def test_a_missing_argument_gets_tritons_error(kernel):
    launcher = Launcher(kernel.fn)
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    launcher.launch((1,), **kw)
    launcher.launch((1,), **kw)
    del kw["n"]
    with pytest.raises(TypeError, match="n"):
        launcher.launch((1,), **kw)


def _shadowing_kernel_fn(P, P_0, _P_0, X):
    pass


def test_the_guards_own_names_do_not_shadow_arguments(kernel):
    fn = jit.JITFunction(_shadowing_kernel_fn)
    base = dict(P=(16, 32), P_0=48, _P_0=3, X=torch.zeros(4), debug=False, instrumentation_mode="")
    assert fast_launch._guard(fn, base) is None  # a parameter named like the guard's names: the binder's path

    def fn2(P, P_0, Q_0_1, Q):
        pass

    fn = jit.JITFunction(fn2)
    base = dict(P=(16, 32), P_0=48, Q_0_1=64, Q=((16, 32), 2), debug=False, instrumentation_mode="")
    values = fast_launch._guard(fn, base)(**base)
    assert values == (base["P"], 48, 64, base["Q"])


def test_the_guard_is_on_for_the_pinned_triton_only(kernel, monkeypatch):
    """The guard encodes triton 3.6's specialisation rules: on another Triton (CI pins 3.6) this fails until
    someone has read that version's binder; with the gate off every launch takes the binder and keeps no guard."""
    assert fast_launch._GUARDED, f"triton {triton.__version__}: check its binder's rules, then widen _GUARDED"
    kw = dict(X=torch.zeros(8), n=32, scale=0.5, ROWS=4)
    on = Launcher(kernel.fn)
    for _ in range(2):
        on.launch((1,), **kw)
    assert len(on._seen[0]) == 1
    monkeypatch.setattr(fast_launch, "_GUARDED", False)
    off = Launcher(kernel.fn)
    for _ in range(3):
        off.launch((1,), **kw)
    assert off._seen == {} and _direct(kernel.launches[-1])
