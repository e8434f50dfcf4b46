"""The STU benchmark's code path on the CPU, with a tiny configuration, its memory bound and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flexhstu.bench import stu_step

TINY = [
    "--device",
    "cpu",
    "--layers",
    "2",
    "--dim",
    "16",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--batch",
    "3",
    "--seq",
    "12",
    "--jagged-min",
    "0",
    "--jagged-max",
    "20",
    "--window",
    "4",
    "--sla-k1",
    "4",
    "--sla-k2",
    "2",
    "--compile-backend",
    "aot_eager",
]


def test_suite_writes_one_row_per_configuration_and_variant(tmp_path, capsys):
    out = tmp_path / "rows.json"
    # The compiled variants are the next test's (compiling is slow on the CPU).
    variants = ["eager", "lean", "default", "default+keep_u"]
    assert stu_step.main(TINY + ["--suite", "--variants", *variants, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    configs = [f"{m} {k}" for m, k in stu_step.SUITE]
    assert [(r["config"].rsplit(" ", 2)[0], r["variant"]) for r in rows] == [(c, v) for c in configs for v in variants]
    assert all(r["step_ms"] > 0 and r["peak_gib"] is None for r in rows)
    assert rows[0]["total"] == 3 * 12 and rows[0]["max_seq_len"] == 12
    jagged = next(r for r in rows if "jagged" in r["config"])
    assert 0 <= jagged["max_seq_len"] <= 20
    out, err = capsys.readouterr()
    assert out.count("\n| ") == len(rows) + 1  # the header and one line per row
    assert "a step needs up to 0.00 GiB (estimate)" in out.splitlines()[0]
    starts = [line for line in err.splitlines() if "first step" in line]  # progress, one line per step as it starts
    assert len(starts) == len(rows) and starts[-1].startswith(f"[{len(rows)}/{len(rows)}, ")


def test_compiled_variants_run(tmp_path):
    out = tmp_path / "rows.json"
    assert stu_step.main(TINY + ["--mask", "sla", "--variants", "compiled", "lean+compiled", "--json", str(out)]) == 0
    assert [r["variant"] for r in json.loads(out.read_text())] == ["compiled", "lean+compiled"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without a CUDA device")
def test_cuda_device_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        stu_step.main(["--variants", "eager"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flexhstu bench --model-step: error: --device: expected cpu here"), err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--layers", "0"], "--layers: expected a positive int, got 0"),
        (["--jagged-min", "9", "--jagged-max", "3"], "expected 0 <= min <= max, got 9, 3"),
        # One line each, before the benchmark runs: not a traceback (after the run, for --json), nor 16 lines of usage.
        (["--mask", "window", "--window", "-1"], "--window: expected an int >= 0, got -1"),
        (["--device", "foo"], "--device: expected cuda or cpu, got 'foo'"),
        (["--json", "."], "--json: expected a file that can be written, got '.'"),
        (["--json", "/no/such/folder/x.json"], "--json: expected a file that can be written"),
    ],
)
def test_bad_sizes_name_the_option(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        stu_step.main(TINY + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err


def test_sizes_that_do_not_fit_are_refused_in_one_line_before_the_run(monkeypatch, capsys):
    # The defaults on a 24 GB CPU machine: run, they print the table header and are killed at 23.6 GB resident
    # (on the CPU the reference attention holds float32 (B, H, N, N) scores per layer).
    monkeypatch.setattr(stu_step, "available_bytes", lambda device: 24 * 10**9)
    with pytest.raises(SystemExit) as e:
        stu_step.main(["--device", "cpu"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.splitlines() == [
        "flexhstu bench --model-step: error: --batch 16 --seq 4096 --layers 4 --dim 512 --heads 4 --head-dim 128 "
        "(bfloat16): a step needs up to 73.4 GiB (estimate), 22.4 GiB available on cpu; lower --batch, --seq, --heads "
        "or --layers"
    ]
    with pytest.raises(SystemExit):  # the suite's jagged configuration is the largest: its length is named
        stu_step.main(["--device", "cpu", "--suite", "--batch", "4", "--seq", "1024"])
    err = capsys.readouterr().err
    assert "--batch 4 --jagged-max 8192 " in err and "lower --batch, --jagged-max," in err


def test_the_estimate_bounds_a_measured_step_on_the_cpu():
    args = [
        "--device",
        "cpu",
        "--layers",
        "2",
        "--dim",
        "64",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--batch",
        "4",
        "--seq",
        "768",
        "--variants",
        "eager",
    ]
    # What the step holds, in a child: its high-water mark (VmHWM; ru_maxrss would carry this process's over the
    # exec) above its memory after a tiny step (lazy imports), with glibc returning every block above 64 KiB at
    # once (a fixed mmap threshold: otherwise freed blocks stay in the arenas, and what is measured is theirs).
    child = (
        "import sys\nfrom flexhstu.bench import stu_step\n"
        "def kib(key): return int(next(x for x in open('/proc/self/status') if x.startswith(key)).split()[1])\n"
        "stu_step.main(sys.argv[1:] + ['--seq', '8'])\nbefore = kib('VmRSS:')\nstu_step.main(sys.argv[1:])\n"
        "print('grew', (kib('VmHWM:') - before) * 1024)"
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    grew = int(run.stdout.split("grew ")[1])
    bound, _, _ = stu_step.memory_check(stu_step.parse(args), torch.device("cpu"))
    assert grew < bound < 3 * grew, (grew, bound)  # a bound, and not a loose one
    # the reporter's sizes: above the 23.6 GB at which that run was killed
    assert (
        stu_step.step_bytes(layers=4, dim=512, heads=4, head_dim=128, lengths=[4096] * 16, itemsize=2, dense=True)
        > 23.6e9
    )


def test_free_memory_is_what_cuda_reports_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 2**30, 80 * 2**30))
    assert stu_step.available_bytes(torch.device("cuda")) == 5 * 2**30
