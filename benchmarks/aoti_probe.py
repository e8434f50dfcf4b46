"""Where AOTInductor fails on the GPU: small cases, each compiled, loaded and run in a process of its own.

    PYTHONPATH=$PWD python benchmarks/aoti_probe.py            # every case, one child process each
    PYTHONPATH=$PWD python benchmarks/aoti_probe.py --case delta

The serving scorer's package segfaults in ``aoti_load_package`` on the H200 (torch 2.11+cu130). The cases
narrow it down: ``linear`` (no custom op at all), ``pyop`` (a ``torch.library.custom_op`` with a PyTorch body,
no flexhstu), ``delta`` (the ``flexhstu::delta_hstu_mha_fwd`` op alone, Triton inside), ``scorer-ref`` (the
OneRank micro-batch scorer with the PyTorch reference attention: no custom op) and ``scorer`` (the scorer with
the Triton op, as ``flexhstu bench --serving --aoti``); and ways around the loader for ``linear``: on the CPU
(``linear-cpu``), ``run_single_threaded`` (``linear-single``), the older ``aot_compile`` / ``aot_load``
(``linear-legacy``), the package's shared object run by ``AOTIModelContainerRunnerCuda`` (``linear-runner``),
weights kept out of the package and loaded after (``linear-noconst``), and a module with no weights at all
(``constfree``: ``relu(x @ w)`` with ``w`` an input).
A child that dies of a signal is run again for a native backtrace: under ``gdb -batch`` when gdb is
installed, else with a small SIGSEGV handler (compiled here with gcc, ``LD_PRELOAD``) that prints the frames'
libraries, offsets and symbols (``backtrace`` and ``dladdr``), demangled by ``c++filt``.
Prints one line per case: ok (with the largest difference from eager), error (the exception's last line) or the signal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

CASES = (
    "linear",
    "linear-cpu",
    "linear-single",
    "linear-legacy",
    "linear-runner",
    "linear-noconst",
    "constfree",
    "pyop",
    "delta",
    "scorer-ref",
    "scorer",
)


@torch.library.custom_op("flexhstu_probe::scale_add", mutates_args=())
def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha + y


@scale_add.register_fake
def _(x, y, alpha):
    return torch.empty_like(x)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)

    def forward(self, x):
        return torch.relu(self.lin(x))


class ConstFree(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)


class PyOp(Linear):
    def forward(self, x):
        y = self.lin(x)
        return scale_add(y, y, 0.5).sum(-1)


class Delta(torch.nn.Module):
    """One delta attention call: the last 4 rows of every sequence against all of it (causal)."""

    def forward(self, q, k, v, offsets):
        from flexhstu import Kernel, delta_hstu_mha

        return delta_hstu_mha(64, None, q, k, v, offsets, kernel=Kernel.TRITON)


def _case_inputs(case: str, device: torch.device):
    """``(module, args, dynamic_shapes or None)`` of a case."""
    torch.manual_seed(0)
    if case == "constfree":
        return ConstFree(), (torch.randn(8, 64, device=device), torch.randn(64, 32, device=device)), None
    if case.startswith("linear") or case == "pyop":
        return (PyOp() if case == "pyop" else Linear()).to(device), (torch.randn(8, 64, device=device),), None
    if case == "delta":
        from flexhstu.jagged import offsets_from_lengths

        offs = offsets_from_lengths([40, 64, 17], device=device)
        kv = [torch.randn(121, 2, 32, device=device, dtype=torch.bfloat16) for _ in range(2)]
        q = torch.randn(12, 2, 32, device=device, dtype=torch.bfloat16)
        return Delta(), (q, kv[0], kv[1], offs), None
    from flexhstu import Kernel
    from flexhstu.bench.serving_aoti import example_inputs
    from flexhstu.bench.serving_setup import Setup, build_model
    from flexhstu.serving.export import MicroBatchScorer, scorer_dynamic_shapes

    backend = Kernel.PYTORCH if case == "scorer-ref" else Kernel.TRITON
    setup = Setup(device, torch.bfloat16, backend, dim=128, heads=2, samples=1, warmup=0, seed=0)
    model = build_model(setup, layers=2, max_hist=64)
    inputs = example_inputs(model, setup, max_seq_len=128)
    return MicroBatchScorer(model, 128), tuple(inputs), scorer_dynamic_shapes(inputs)


def run_case(case: str) -> int:
    import torch._inductor
    import torch.fx.experimental._config

    import flexhstu  # noqa: F401  (registers the custom ops)

    device = torch.device("cpu" if case == "linear-cpu" else "cuda")
    module, args, dynamic = _case_inputs(case, device)
    with torch.no_grad():
        eager = module(*args)
        if dynamic is None:
            program = torch.export.export(module, args)
        else:
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                program = torch.export.export(module, args, dynamic_shapes=dynamic)
        print(
            f"[{case}] exported; custom ops in the graph:",
            sorted(
                {
                    str(n.target)
                    for n in program.graph.nodes
                    if n.op == "call_function"
                    and "::" in str(getattr(n.target, "_name", ""))
                    and not str(n.target).startswith("aten")
                }
            ),
            flush=True,
        )
        with tempfile.TemporaryDirectory() as folder:
            if case == "linear-legacy":
                so = torch._inductor.aot_compile(program.module(), args)
                print(f"[{case}] compiled: {so}", flush=True)
                _show_libraries(Path(so).parent)
                loaded = torch._export.aot_load(so, "cuda")
            else:
                configs = {"aot_inductor.package_constants_in_so": False} if case == "linear-noconst" else {}
                path = torch._inductor.aoti_compile_and_package(
                    program, package_path=str(Path(folder) / f"{case}.pt2"), inductor_configs=configs
                )
                print(f"[{case}] compiled: {path}", flush=True)
                _show_loaded_cxx_runtime(case)
                if case == "linear":
                    unpacked = Path(folder) / "unpacked"
                    zipfile.ZipFile(path).extractall(unpacked)
                    _show_libraries(unpacked)
                if case == "linear-runner":
                    unpacked = Path(folder) / "unpacked"
                    zipfile.ZipFile(path).extractall(unpacked)
                    so = next(unpacked.rglob("*.so"))
                    runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(so), 1, "cuda", str(so.parent))
                    print(f"[{case}] runner made", flush=True)
                    loaded = lambda *xs: runner.run(list(xs))[0]
                else:
                    loaded = torch._inductor.aoti_load_package(path, run_single_threaded=case == "linear-single")
                    if case == "linear-noconst":
                        params = dict(module.named_parameters())
                        fqns = loaded.get_constant_fqns()
                        print(f"[{case}] constants: {fqns}", flush=True)
                        loaded.load_constants({f: params[f] for f in fqns}, check_full_update=True)
            print(f"[{case}] loaded", flush=True)
            got = loaded(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
    err = (got.float() - eager.float()).abs().max().item() / max(eager.float().abs().max().item(), 1e-30)
    print(f"[{case}] ran; max difference from eager over the largest output: {err:.2e}", flush=True)
    return 0


def _show_libraries(folder: Path) -> None:
    """What the compiled shared objects link against (``ldd``): a missing or mismatched library shows here."""
    for so in sorted(folder.rglob("*.so")):
        r = subprocess.run(["ldd", str(so)], capture_output=True, text=True)
        print(f"ldd {so.name}:\n  " + "\n  ".join((r.stdout + r.stderr).strip().splitlines()), flush=True)


def _show_loaded_cxx_runtime(case: str) -> None:
    """The C++ runtime this process has loaded (the package's shared object uses it) and the compiler's own."""
    with open("/proc/self/maps") as f:
        loaded = sorted({ln.split()[-1] for ln in f if "libstdc++" in ln or "libc++" in ln})
    compiler = ""
    if shutil.which("g++"):
        compiler = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout
    print(f"[{case}] C++ runtime loaded: {loaded}; g++'s: {os.path.realpath(compiler.strip()) if compiler else '-'}")


def _environment() -> None:
    """The toolchain AOTInductor compiles with."""
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | {torch.cuda.get_device_name()}", flush=True)
    for tool in (["nvcc", "--version"], ["gcc", "--version"], ["g++", "--version"]):
        path = shutil.which(tool[0])
        first = subprocess.run(tool, capture_output=True, text=True).stdout.strip().splitlines() if path else []
        print(f"{tool[0]}: {path} {first[-1] if tool[0] == 'nvcc' and first else (first[0] if first else '')}")
    print("CUDA_HOME", os.environ.get("CUDA_HOME"), "| LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH"), flush=True)


SEGV_HANDLER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
static void report(int sig, siginfo_t *si, void *ctx) {
  void *frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "native: signal %d, faulting address %p\n", sig, si->si_addr);
  for (int i = 0; i < n; i++) {
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname)
      fprintf(stderr, "#%d %s+0x%lx %s\n", i, d.dli_fname, (unsigned long)((char *)frames[i] - (char *)d.dli_fbase),
              d.dli_sname ? d.dli_sname : "?");
    else
      fprintf(stderr, "#%d %p\n", i, frames[i]);
  }
  fflush(stderr);
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = report;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
"""


def _segv_handler(folder: Path) -> Path | None:
    """The SIGSEGV handler above as a shared object to preload, or None without gcc."""
    if not shutil.which("gcc"):
        return None
    src, lib = folder / "segv.c", folder / "segv.so"
    src.write_text(SEGV_HANDLER)
    r = subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-o", str(lib), str(src), "-ldl"], capture_output=True)
    return lib if r.returncode == 0 else None


def _child(case: str, timeout: int, under_gdb: bool = False, preload: Path | None = None):
    cmd = [sys.executable, *([] if preload else ["-X", "faulthandler"]), __file__, "--case", case]
    if under_gdb:
        cmd = ["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary", "--args", *cmd]
    env = os.environ.copy()
    if preload:
        env["LD_PRELOAD"] = f"{preload} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(preload)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _demangled(lines: list[str]) -> list[str]:
    """Frames ``#i LIB+0xOFF SYMBOL``: a missing symbol looked up by ``addr2line`` (the library's own symbol
    table), every symbol demangled by ``c++filt``; where a tool is missing the line stays as it is."""
    out = []
    for ln in lines:
        parts = ln.split()
        if len(parts) == 3 and parts[2] == "?" and "+0x" in parts[1] and shutil.which("addr2line"):
            lib, off = parts[1].rsplit("+", 1)
            r = subprocess.run(["addr2line", "-f", "-e", lib, off], capture_output=True, text=True)
            name = (r.stdout.splitlines() or ["??"])[0]
            ln = f"{parts[0]} {parts[1]} {name if name != '??' else '?'}"
        out.append(ln)
    if not shutil.which("c++filt"):
        return out
    return subprocess.run(["c++filt"], input="\n".join(out), capture_output=True, text=True).stdout.splitlines()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=CASES)
    p.add_argument("--only", nargs="*", choices=CASES, default=list(CASES))
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--log-dir", default="")
    args = p.parse_args()
    if args.case == "linear-cpu":
        return run_case(args.case)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.case:
        return run_case(args.case)
    _environment()
    logs = Path(args.log_dir) if args.log_dir else None
    for case in args.only:
        try:
            r = _child(case, args.timeout, under_gdb=False)
        except subprocess.TimeoutExpired:
            print(f"{case:11} timeout after {args.timeout} s", flush=True)
            continue
        text = r.stdout + r.stderr
        if r.returncode == 0:
            status = "ok   " + next((ln for ln in text.splitlines() if "max difference" in ln), "")
        elif r.returncode < 0:
            status = f"died of {signal.Signals(-r.returncode).name}"
        else:
            status = "error " + (text.strip().splitlines() or ["(no output)"])[-1][:300]
        print(f"{case:11} {status}", flush=True)
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"aoti-{case}.log").write_text(text)
        if r.returncode < 0 and shutil.which("gdb"):
            try:
                g = _child(case, args.timeout, under_gdb=True)
                bt = [ln for ln in (g.stdout + g.stderr).splitlines() if ln.startswith("#")]
                print("    gdb backtrace:\n      " + "\n      ".join(bt[:25]), flush=True)
                if logs:
                    (logs / f"aoti-{case}-gdb.log").write_text(g.stdout + g.stderr)
            except subprocess.TimeoutExpired:
                print("    gdb: timeout", flush=True)
        elif r.returncode < 0:
            with tempfile.TemporaryDirectory() as folder:
                lib = _segv_handler(Path(folder))
                if lib is None:
                    print("    (no gdb nor gcc on this machine: faulthandler's Python trace is in the log)", flush=True)
                    continue
                try:
                    n = _child(case, args.timeout, preload=lib)
                except subprocess.TimeoutExpired:
                    print("    native backtrace: timeout", flush=True)
                    continue
            bt = _demangled([ln for ln in n.stderr.splitlines() if ln.startswith(("#", "native:"))])
            head = "    native backtrace (no gdb here; a preloaded handler):"
            print(head + "\n      " + "\n      ".join(bt[:30]), flush=True)
            if logs:
                (logs / f"aoti-{case}-native.log").write_text(n.stdout + "\n".join(_demangled(n.stderr.splitlines())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
