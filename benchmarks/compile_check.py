"""Compile every Triton kernel variant for sm_90 on a machine without a GPU; print registers and spills.

    PYTHONPATH=$PWD python benchmarks/compile_check.py           # bf16 D 64/128/256/96 and 24/48, every MODE; fp32
    PYTHONPATH=$PWD python benchmarks/compile_check.py --quick   # D 128 and 96 only
    PYTHONPATH=$PWD python benchmarks/compile_check.py --quick --sass DIR   # and each variant's SASS in DIR
    COMPILE_CHECK_VERBOSE=1 PYTHONPATH=$PWD python benchmarks/compile_check.py ...  # a failure's whole error

Every dim also compiles the kernels with the relative attention bias (``rel_bias``: HAS_BIAS, and
BIAS_GRAD in the dK/dV kernel) for the causal, fixed-rule window and SLA masks; the lines show ``HAS_BIAS=True``;
and with a dense bias (``rab``: HAS_RAB, RAB_GRAD), shown as ``HAS_RAB=True``.

The real entry point (``triton_hstu_mha``, forward and backward) runs on CPU tensors
while ``JITFunction.run`` is replaced by a function that binds the launch arguments
exactly as Triton's launcher does (same specialisation of ints and pointers, same
constexprs, tuples included), compiles the kernel for sm_90 with the ptxas of the
triton wheel and records what ``cuobjdump`` reports, instead of launching. So a
kernel that the interpreter accepts but the GPU compiler rejects fails here, and a
change that moves registers or spills shows up without device time. Exit status 1
when a variant does not compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flexhstu import masks, quantize_fp8
from flexhstu.jagged import offsets_from_lengths
from flexhstu.ops.bias import RelativeBias
from flexhstu.ops.triton import triton_hstu_mha
from flexhstu.ops.triton.delta_op import triton_delta_hstu_mha

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SHOWN = ("MODE", "NFUNC", "DIM_QK", "DIM_V", "BLOCK_M", "BLOCK_N", "DOT_PRECISION", "HAS_BIAS", "HAS_RAB", "HAS_SCALES")
seen: set[str] = set()
failures: list[str] = []
SASS_DIR = sys.argv[sys.argv.index("--sass") + 1] if "--sass" in sys.argv else None


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True).stdout


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the kernel in ``cubin``; ptxas spills to the stack."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"STACK:(\d+)", text).group(1))


def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    if self.fn.__name__ == "_safe_offsets_kernel":  # later host code reads its output: the inputs' offsets are valid
        named = {**dict(zip(self.arg_names, args)), **kwargs}  # launched by keyword (fast_launch.Launcher)
        named["OUT"].copy_(named["OFFS"])
    kwargs["debug"] = False
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, specialization, options)
    names = {path[0]: value for path, value in constexprs.items() if len(path) == 1}
    shown = " ".join(f"{self.arg_names[i]}={v}" for i, v in sorted(names.items()) if self.arg_names[i] in SHOWN)
    key = f"{self.fn.__name__} {shown} {signature} warps={options.num_warps} stages={options.num_stages}"
    if key in seen:
        return None
    seen.add(key)
    label = f"{self.fn.__name__:26} {shown} warps={options.num_warps} stages={options.num_stages}"
    try:
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    except Exception as e:  # reported per variant; the script exits 1 at the end
        failures.append(label)
        print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[-1][:200]}", flush=True)
        if os.environ.get("COMPILE_CHECK_VERBOSE"):  # the innermost error whole (Triton's own message)
            while e.__cause__ is not None:
                e = e.__cause__
            print(e, flush=True)
        return None
    regs, stack = _resources(kernel.asm["cubin"])
    print(f"ok   {label:110} regs={regs:3} spill_stack={stack}B", flush=True)
    if SASS_DIR:
        os.makedirs(SASS_DIR, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{len(seen):03d} {label}")[:150]
        with open(os.path.join(SASS_DIR, name + ".sass"), "w") as f:
            # cuobjdump's own listing: Triton's asm["sass"] stops at the first 5-digit address (4096 instructions).
            f.write(_cuobjdump(kernel.asm["cubin"], "-sass"))
    return None


def run(dtype, dqk, dv, case, bias=False, rab=False):
    lengths = [300, 77, 0, 129]
    offs = offsets_from_lengths(lengths)
    total = sum(lengths)
    q, k = (torch.randn(total, 2, dqk, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(total, 2, dv, dtype=dtype, requires_grad=True)
    kw = dict(alpha=0.1, out_scale=1 / 300, max_seq_len=300)
    if case == "causal":
        kw["causal_closed_form"] = True
    elif case == "fixed":
        kw.update(num_targets=torch.tensor([5, 5, 0, 5]), contextual=3, window=10)
    elif case == "func3":
        kw["func"] = masks.sla(offs, 20, 4)
    elif case == "func9":  # five intervals: the path without register-resident intervals
        kw["func"] = torch.zeros(2, 9, total, dtype=torch.int32)
    inputs = [q, k, v]
    if bias:  # shared position table, per-head time table; both require grad (the dK/dV kernel reduces them)
        tables = [torch.randn(599, requires_grad=True), torch.randn(2, 129, requires_grad=True)]
        kw["rel_bias"] = RelativeBias(*tables, torch.arange(total) * 1000)
        inputs += tables
    if rab:  # a dense bias per head, with grad (the dK/dV kernel writes its gradient)
        kw["rab"] = torch.randn(len(lengths), 2, 300, 300, requires_grad=True)
        inputs.append(kw["rab"])
    out = triton_hstu_mha(q, k, v, offs, **kw)
    torch.autograd.grad(out, inputs, torch.randn(total, 2, dv, dtype=dtype))


def run_delta(dqk, dv, case, fp8=False):
    """The delta (serving) forward on 40 new rows of each sequence, bf16 or e4m3 inputs (``flexhstu.quantize_fp8``)."""
    lengths, new = [300, 77, 0, 129], [40, 40, 0, 40]
    offs, q_offs = offsets_from_lengths(lengths), offsets_from_lengths(new)
    q = torch.randn(sum(new), 2, dqk, dtype=torch.bfloat16)
    k = torch.randn(sum(lengths), 2, dqk, dtype=torch.bfloat16)
    v = torch.randn(sum(lengths), 2, dv, dtype=torch.bfloat16)
    kw = dict(alpha=0.1, out_scale=1 / 300)
    if case == "causal":
        kw["causal_closed_form"] = True
    elif case == "func3":
        kw["func"] = masks.sla(offs, 20, 4)[:, :, : sum(new)]
    if fp8:
        (q, qs), (k, ks), (v, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
        kw["fp8_scales"] = (qs, ks, vs)
    q_start = torch.tensor([260, 37, 0, 89])
    triton_delta_hstu_mha(q, k, v, offs, q_offs, q_start, **kw)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for the GPU")
        return 2
    JITFunction.run = compile_instead_of_launch
    dims = [(128, 128), (96, 96)] if "--quick" in sys.argv else [(64, 64), (128, 128), (256, 256), (96, 96), (24, 48)]
    for dqk, dv in dims:
        for case in ("causal", "fixed", "func3", "func9"):
            print(f"## bf16 Dqk{dqk} Dv{dv} {case}", flush=True)
            run(torch.bfloat16, dqk, dv, case)
        for case in ("causal", "fixed", "func3"):  # fixed: a window, so sparse (non-square) tiles
            print(f"## bf16 Dqk{dqk} Dv{dv} {case} with rel_bias", flush=True)
            run(torch.bfloat16, dqk, dv, case, bias=True)
            print(f"## bf16 Dqk{dqk} Dv{dv} {case} with a dense rab", flush=True)
            run(torch.bfloat16, dqk, dv, case, rab=True)
        for case in ("causal", "func3"):
            for fp8 in (False, True):
                print(f"## delta {'e4m3' if fp8 else 'bf16'} Dqk{dqk} Dv{dv} {case}", flush=True)
                run_delta(dqk, dv, case, fp8)
    torch.backends.cuda.matmul.allow_tf32 = False
    print("## fp32 IEEE dots, D 64, func3", flush=True)
    run(torch.float32, 64, 64, "func3")
    print("## fp32 IEEE dots, D 64, func3 with rel_bias", flush=True)
    run(torch.float32, 64, 64, "func3", bias=True)
    print(f"\n{len(seen)} variants, {len(failures)} failed" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
