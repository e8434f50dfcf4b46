"""The STU benchmark's code path on the CPU, with a tiny configuration, and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from flexhstu.bench import stu

TINY = ["--device", "cpu", "--layers", "2", "--dim", "16", "--heads", "2", "--head-dim", "8", "--batch", "3",
        "--seq", "12", "--jagged-min", "0", "--jagged-max", "20", "--window", "4", "--sla-k1", "4", "--sla-k2", "2",
        "--compile-backend", "aot_eager"]


def test_suite_writes_one_row_per_configuration_and_variant(tmp_path, capsys):
    out = tmp_path / "rows.json"
    variants = ["eager", "lean", "default"]  # the compiled ones are the next test's (compiling is slow on the CPU)
    assert stu.main(TINY + ["--suite", "--variants", *variants, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    configs = [f"{m} {k}" for m, k in stu.SUITE]
    assert [(r["config"].rsplit(" ", 2)[0], r["variant"]) for r in rows] == [(c, v) for c in configs for v in variants]
    assert all(r["step_ms"] > 0 and r["peak_gib"] is None for r in rows)
    assert rows[0]["total"] == 3 * 12 and rows[0]["max_seq_len"] == 12
    jagged = next(r for r in rows if "jagged" in r["config"])
    assert 0 <= jagged["max_seq_len"] <= 20
    table = capsys.readouterr().out
    assert table.count("\n| ") == len(rows) + 1  # the header and one line per row


def test_compiled_variants_run(tmp_path):
    out = tmp_path / "rows.json"
    assert stu.main(TINY + ["--mask", "sla", "--variants", "compiled", "lean+compiled", "--json", str(out)]) == 0
    assert [r["variant"] for r in json.loads(out.read_text())] == ["compiled", "lean+compiled"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without a CUDA device")
def test_cuda_device_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        stu.main(["--variants", "eager"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flexhstu bench --model-step: error: --device: expected cpu here"), err


@pytest.mark.parametrize(("args", "words"), [
    (["--layers", "0"], "--layers: expected a positive int, got 0"),
    (["--jagged-min", "9", "--jagged-max", "3"], "expected 0 <= min <= max, got 9, 3"),
    # User trial: tracebacks (the last two after the benchmark had run), and 16 lines of usage before errors.
    (["--mask", "window", "--window", "-1"], "--window: expected an int >= 0, got -1"),
    (["--device", "foo"], "--device: expected cuda or cpu, got 'foo'"),
    (["--json", "."], "--json: expected a file that can be written, got '.'"),
    (["--json", "/no/such/folder/x.json"], "--json: expected a file that can be written"),
])
def test_bad_sizes_name_the_option(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        stu.main(TINY + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err
