"""benchmarks/host_cpu.py runs the real entry point with Triton's driver and compiled kernels faked: after the
first call every launch of a forward+backward goes through fast_launch.Launcher's direct path (Triton's binder
and cache key find the kernel each time), for the real kernels and their real arguments."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_launch_of_a_warm_call_is_direct():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_cpu.py"), "--runs", "1", "--per-run", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("== ")]
    assert len(lines) == 3, out.stdout
    # Causal (S1024) and the window (it bounds every key block's range to one piece): no split rows to zero.
    for line in lines[:2]:
        assert "launches of a fwd+bwd: direct, direct, direct)" in line, line
    # SLA: its global prefix's key blocks are split, their rows zeroed first.
    assert "launches of a fwd+bwd: direct, direct, direct, direct)" in lines[2], lines[2]
