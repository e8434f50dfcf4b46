"""The serving benchmark's code path on the CPU with tiny sizes: every row of the grid, exact pair counts, cached
scores equal to the full recompute's, errors as rows, the AOTI comparison, and the command's one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flexhstu.bench import serving, serving_aoti
from flexhstu.cli import main as cli_main
from flexhstu.models import OneRankModel

TINY = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--backend",
    "pytorch",
    "--hist",
    "5,8",
    "--cands",
    "3",
    "--micro-batch",
    "2,all",
    "--layers",
    "1",
    "--users",
    "1,2",
    "--dim",
    "16",
    "--heads",
    "2",
    "--samples",
    "2",
    "--warmup",
    "1",
]
interpreting = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on the CPU need TRITON_INTERPRET=1"
)


def run(args, tmp_path) -> tuple[int, list[dict]]:
    out = tmp_path / "rows.json"
    status = serving.main(args + ["--json", str(out)])
    return status, json.loads(out.read_text())["rows"]


def test_every_configuration_gets_a_row_and_cached_scores_equal_the_full_recompute(tmp_path, capsys):
    status, rows = run(TINY, tmp_path)
    assert status == 0
    scoring = [r for r in rows if r["part"] == "scoring"]
    # full at micro-batch 2: one forward per micro-batch, each recomputing the histories (3 candidates: 2 + 1)
    want = [
        (h, u, path, mb)
        for h in (5, 8)
        for u in (1, 2)
        for path, mb in (
            ("full", None),
            ("full", 2),
            ("cached", 2),
            ("cached, e4m3", 2),
            ("cached", None),
            ("cached, e4m3", None),
        )
    ]
    assert [(r["hist"], r["users"], r["path"], r["micro_batch"]) for r in scoring] == want
    for r in scoring:
        assert r["status"] == "ok" and r["samples"] == 2 and r["median_ms"] <= r["p99_ms"]
        assert r["cands_per_s"] == pytest.approx(r["users"] * 3 / (r["median_ms"] / 1e3))
        if r["path"] == "cached" or (r["path"] == "full" and r["micro_batch"]):
            assert r["rel_diff"] < 1e-5  # the same scores as the full recompute in one forward
        if r["path"] == "cached, e4m3":
            assert 0 < r["rel_diff"] < 0.1  # e4m3's own error
    out = capsys.readouterr().out
    assert "| history | cands/user | layers | users | path |" in out and "| kernel | pairs (M) |" in out


def test_kernel_rows_count_the_visible_pairs_exactly(tmp_path):
    _, rows = run(TINY + ["--part", "kernel"], tmp_path)
    assert {r["part"] for r in rows} == {"kernel"}
    heads = 2
    for r in rows:
        h, c, u = r["hist"], r["cands"], r["users"]
        # A candidate sees the history and itself; a task token the history, its candidate and itself.
        delta = u * c * ((h + 1) + 3 * (h + 2)) * heads
        history = u * h * (h + 1) // 2 * heads  # causal history rows
        assert r["pairs"] == (delta + history if r["kernel"] == "full, onerank" else delta), r
        assert r["status"] == "ok" and r["tflops"] > 0
    assert [(r["hist"], r["users"], r["cands"]) for r in rows[::4]] == [
        (h, u, c) for h in (5, 8) for u in (1, 2) for c in (2, 3)
    ]  # micro-batch 2, and all 3
    assert [r["kernel"] for r in rows[:4]] == ["delta", "delta, e4m3", "full, same pairs", "full, onerank"]


def test_out_of_memory_becomes_the_rows_status_and_the_run_goes_on(tmp_path, monkeypatch):
    real = OneRankModel.score_cached

    def short_of_memory(self, cache, users, cand_items, cand_offsets, micro_batch=None, cuda_graphs=None, fp8=False):
        if micro_batch == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, cache, users, cand_items, cand_offsets, micro_batch, cuda_graphs, fp8=fp8)

    monkeypatch.setattr(OneRankModel, "score_cached", short_of_memory)
    status, rows = run(TINY + ["--part", "scoring", "--hist", "5", "--users", "2"], tmp_path)
    assert status == 0
    assert [(r["path"], r["micro_batch"], r["status"]) for r in rows] == [
        ("full", None, "ok"),
        ("full", 2, "ok"),
        ("cached", 2, "oom"),
        ("cached, e4m3", 2, "oom"),
        ("cached", None, "ok"),
        ("cached, e4m3", None, "ok"),
    ]
    assert rows[2]["median_ms"] is None


def test_an_input_the_library_refuses_becomes_the_rows_status(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton then refuses CPU tensors, naming the device
    args = TINY + ["--backend", "triton", "--hist", "5", "--users", "1"]
    status, rows = run(args, tmp_path)
    assert status == 0
    assert len(rows) == 6 + 2 * 4  # full in one forward and per micro-batch, 2 x 2 cached; 2 sizes of 4 kernels
    for r in rows:
        assert r["status"].startswith("unsupported: q.device: expected CUDA for Kernel.TRITON"), r
    assert all(r["status"].endswith("(caching the histories)") for r in rows if r.get("path") == "cached")


@interpreting
def test_aoti_package_gives_the_eager_scores(tmp_path):
    # The whole AOTInductor path on the CPU: export with dynamic sizes, compile (gcc), load, compare, time. The
    # Triton backend puts the flexhstu::delta_hstu_mha_fwd custom op in the graph, as on the GPU.
    args = [
        "--aoti",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--backend",
        "triton",
        "--hist",
        "6",
        "--cands",
        "3",
        "--micro-batch",
        "all",
        "--layers",
        "1",
        "--users",
        "1,3",
        "--dim",
        "16",
        "--heads",
        "2",
        "--samples",
        "1",
        "--warmup",
        "0",
    ]
    status, rows = run(args, tmp_path)
    assert status == 0
    assert [(r["users"], r["cands"]) for r in rows] == [(1, 3), (3, 3)]  # one package for any number of users
    for r in rows:
        assert r["status"] == "ok" and r["passed"] and r["rel_diff"] <= 1e-5 and r["tolerance"] == 1e-5
        assert r["aoti_median_ms"] > 0 and r["eager_median_ms"] > 0 and r["compile_s"] > 0


def test_aoti_scores_beyond_the_tolerance_fail_the_run(tmp_path, monkeypatch, capsys):
    def off_by_a_percent(scorer, example, package_path):  # stands in for the compiler: eager scores, 1% off
        return lambda *inputs: scorer(*inputs) * 1.01

    monkeypatch.setattr(serving_aoti, "compile_scorer", off_by_a_percent)
    args = TINY + ["--aoti", "--hist", "6", "--users", "2", "--micro-batch", "all"]
    status, rows = run(args, tmp_path)
    assert status == 1
    assert [r["passed"] for r in rows] == [False] and rows[0]["rel_diff"] == pytest.approx(0.01, rel=1e-3)
    captured = capsys.readouterr()
    assert "FAIL (> 1e-05)" in captured.out
    assert "1 AOTI row(s) differ from eager beyond the tolerance" in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer given without a CUDA device")
def test_without_a_gpu_the_command_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main.main(["bench", "--serving", "--quick"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "flexhstu bench --serving: error: --device: expected a CUDA GPU, found none (--device cpu only runs the "
        "code path, for tests)"
    ]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--micro-batch", "64,0"],
            "argument --micro-batch: expected comma-separated integers >= 1 or 'all', got '64,0'",
        ),
        (["--hist", "4096,x"], "argument --hist: expected an integer >= 1, got 'x'"),
        (["--heads", "3"], "--heads: expected a divisor of --dim 16, got 3"),
        (["--device", "tpu"], "--device: expected cuda or cpu, got 'tpu'"),
    ],
)
def test_option_mistakes_are_one_line_naming_the_option(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main.main(["bench", "--serving"] + TINY + args)
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"flexhstu bench --serving: error: {words}"]


def test_quick_is_the_subset_and_given_options_still_apply():
    a = serving.parse(["--quick", "--device", "cpu", "--users", "4"])
    assert (a.hist, a.cands, a.micro_batch, a.layers, a.users) == ([16384], [2048], [256, None], [4], [4])
    full = serving.parse(["--device", "cpu"])
    assert (full.hist, full.cands, full.micro_batch, full.layers, full.users) == (
        [4096, 16384],
        [512, 2048],
        [64, 256, None],
        [2, 4, 8],
        [1, 8, 32],
    )
