"""How the suite runs: on the CPU without TRITON_INTERPRET=1 it stops at collection instead of skipping the Triton
kernel tests (a run that skipped them all passed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collect(path: str, interpret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run(
        [sys.executable, "-m", "pytest", path, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_kernel_tests_without_the_interpreter_stop_the_run_with_one_line():
    run = collect("tests/nn/test_layers.py", None)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("ERROR:")]
    assert run.returncode != 0 and lines == [
        "ERROR: no CUDA device and TRITON_INTERPRET is not 1: 1 Triton kernel test(s) would be skipped; run "
        "`TRITON_INTERPRET=1 python -m pytest ...` (the README's test command sets it)"
    ], run.stdout + run.stderr


def test_the_interpreter_or_no_kernel_test_collects_as_before():
    assert collect("tests/nn/test_layers.py", "1").returncode == 0
    assert collect("tests/masks/test_format.py", None).returncode == 0
