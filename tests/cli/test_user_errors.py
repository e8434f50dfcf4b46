"""A user's mistake gets one line ``flexhstu <command>: error: ...`` and exit status 2; bugs keep their traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import flexhstu.cli.main as cli_main
from flexhstu.cli.common import UserError


def _status(argv) -> int:
    try:
        return cli_main.main(argv)
    except SystemExit as e:  # argparse
        return e.code


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["show-mask", "sla", "--lengths", "5,-3"], "argument --lengths: expected an integer >= 0, got -3"),
        (["show-mask", "sla", "--lengths", "abc"], "argument --lengths: expected an integer >= 0, got 'abc'"),
        (["show-mask", "onerank", "--lengths", "20"], "--targets: expected one target count per sequence"),
        (["show-mask", "onerank", "--lengths", "20", "--targets", "3"], "num_targets[0]: expected a multiple of"),
        (["show-mask", "sla", "--lengths", "20,4", "--targets", "1"], "--targets: expected 2 values"),
        (
            ["show-mask", "sla", "--lengths", "20", "--sla-k1", "0"],
            "argument --sla-k1: expected an integer >= 1, got 0",
        ),
        (["show-mask", "sla", "--lengths", "20,600"], "--lengths: expected lengths up to 512"),
        # Guards against: integers beyond int64 gave "Overflow when unpacking long long" or "Maximum allowed dimension".
        (
            ["show-mask", "sla", "--lengths", "5", "--targets", "99999999999999999999"],
            "argument --targets: expected an integer from 0 to 2^63 - 1 (int64), got 99999999999999999999",
        ),
        (
            ["train", "--data", "synthetic", "--synthetic-users", "99999999999999999999"],
            "argument --synthetic-users: expected an integer from 1 to 2^63 - 1 (int64), got 99999999999999999999",
        ),
        (["show-mask", "causal", "--lengths", "1,2,3,4,5,6,7,8,9"], "--lengths: expected at most 8 sequences"),
        (["show-mask", "sla", "--lengths", "20", "--k1", "3"], "unrecognized arguments: --k1 3"),
        (["train", "--data", "synthetic", "--out", "/dev/null/run"], "--out: Not a directory"),
        (["train", "--data", "synthetic", "--epochs", "0"], "argument --epochs: expected an integer >= 1, got 0"),
        # seed * 1000 + epoch seeds torch's generators, which take values below 2^64 only
        (
            ["train", "--data", "synthetic", "--seed", "18446744073709552"],
            "argument --seed: expected an integer from 0 to 2^53 - 1, got 18446744073709552",
        ),
        (
            ["show-mask", "sla", "--lengths", "20", "-o", "/nonexistent-dir/m.png"],
            "--output: No such file or directory",
        ),
        (["demo", "--out", "/dev/null/x"], "--out: Not a directory"),
        (["train", "--device", "cuda", "--data", "synthetic"], "--device: expected cpu (CUDA is not available here)"),
        # Refused here, not by a traceback from torch later (mps, meta and xpu are devices torch accepts).
        (["train", "--device", "meta", "--data", "synthetic"], "--device: expected cpu or cuda[:N] (the kernels and"),
        (["train", "--device", "gpu", "--data", "synthetic"], "--device: expected cpu or cuda[:N], got 'gpu'"),
        (["recommend", "--users", "1", "--device", "mps"], "--device: expected cpu or cuda[:N] (the kernels and"),
        (["train", "--data", "/nonexistent/ratings.csv"], "--data: expected ml-100k, synthetic or a ratings file"),
        (["train", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
        (["train", "--model", "sasrec", "--no-rel-bias"], "--no-rel-bias: expected --model hstu"),
        (["train", "--model", "popularity", "--no-rel-bias"], "--no-rel-bias: expected --model hstu"),
        (["train", "--no-task-tokens"], "--no-task-tokens: expected --task ranking --model onerank, got --model hstu"),
        # Unchecked, each runs and exits 0 (the mask ignored; HR@10 = 1.0 from a catalogue inside the top K; the
        # whole catalogue ranked).
        (
            ["train", "--model", "popularity", "--mask", "sla"],
            "--mask: expected causal (the default) for --model popularity",
        ),
        (
            ["train", "--data", "synthetic", "--synthetic-items", "5"],
            "--synthetic-items: expected a catalogue of more than 10 items for hr@10",
        ),
        (
            ["train", "--data", "synthetic", "--metrics", "hr@5000"],
            "--metrics: expected a catalogue of more than 5000 items for hr@5000",
        ),
        (["recommend", "--users", "1", "--candidates", ""], "--candidates: expected comma-separated item ids, got ''"),
        # Unchecked, an unclosed quote is read as an id, a folder as --checkpoint is "no such file" and an existing
        # file as --out gives the raw OSError.
        (
            ["recommend", "--users", '"a,b'],
            "--users: expected comma-separated ids (one holding a comma in double "
            "quotes), got '\"a,b' (a quote is not closed)",
        ),
        (["recommend", "--users", "1", "--checkpoint", "."], ".: expected a flexhstu checkpoint, a folder: pass the"),
        # Whole option names only: an abbreviation would change meaning once an option with its prefix is added.
        (["train", "--data", "synthetic", "--ep", "1"], "unrecognized arguments: --ep 1"),
        (["show-mask", "sla", "--len", "20"], "the following arguments are required: --lengths"),
        (["recommend", "--user", "1"], "the following arguments are required: --users"),
        (["bench", "--suit"], "unrecognized arguments: --suit"),
    ],
)
def test_a_mistake_is_one_line_and_status_2(tmp_path, capsys, monkeypatch, argv, fragment):
    if argv[0] == "train":
        argv = argv + ([] if "--out" in argv else ["--out", str(tmp_path / "run")]) + ["--quiet"]
        monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    else:
        monkeypatch.chdir(tmp_path)
    assert _status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flexhstu {argv[0]}: error: ") and fragment in err[0], err


def test_a_bad_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "checkpoint.pt").write_bytes(b"\x00" * 10)
    argv = ["train", "--data", "synthetic", "--resume", "--out", str(tmp_path), "--quiet", "--device", "cpu"]
    assert _status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"flexhstu train: error: {tmp_path / 'checkpoint.pt'}: not a complete flexhstu checkpoint "
        "(UnpicklingError: Weights only load failed)"
    ], err


def test_the_command_line_prints_no_traceback(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexhstu.cli.main",
            "show-mask",
            "onerank",
            "--lengths",
            "20",
            "--targets",
            "3",
            "-o",
            str(tmp_path / "m.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "flexhstu show-mask: error: num_targets[0]: expected a multiple of group_size=4, got 3"
    ]


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(UserError, match="num_targets"):
        cli_main.main(
            ["show-mask", "onerank", "--lengths", "20", "--targets", "3", "--debug", "-o", str(tmp_path / "m.png")]
        )


def test_a_bug_outside_input_validation_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug in the kernel")

    monkeypatch.setattr(cli_main, "hstu_mha", broken)
    with pytest.raises(ValueError, match="a bug in the kernel"):
        cli_main.main(["demo", "--out", str(tmp_path)])


def test_bench_without_a_gpu_is_one_line_and_the_model_step_runs_on_the_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only answer")
    with pytest.raises(SystemExit) as e:
        cli_main.main(["bench"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "flexhstu bench: error: --suite / a custom shape: expected a CUDA GPU, found none "
        "(try --model-step --device cpu)"
    ]
    assert (
        cli_main.main(
            [
                "bench",
                "--model-step",
                "--device",
                "cpu",
                "--layers",
                "1",
                "--dim",
                "32",
                "--heads",
                "2",
                "--head-dim",
                "16",
                "--batch",
                "2",
                "--seq",
                "16",
                "--variants",
                "eager",
            ]
        )
        == 0
    )
    assert "| causal fixed B2 S16 | eager |" in capsys.readouterr().out


def test_a_checkpoint_without_a_runs_entries_is_one_line(tmp_path, capsys):
    from flexhstu import checkpoint

    checkpoint.save({}, tmp_path / "checkpoint.pt")  # a flexhstu file, but not a run's (not a KeyError traceback)
    argv = ["train", "--data", "synthetic", "--resume", "--out", str(tmp_path), "--quiet", "--device", "cpu"]
    assert _status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"flexhstu train: error: {tmp_path / 'checkpoint.pt'}: not a complete flexhstu run checkpoint "
        "(no 'config' entry)"
    ], err


def test_version_prints_the_packages_version(capsys):
    from importlib.metadata import version

    import flexhstu

    assert _status(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flexhstu {flexhstu.__version__}" == f"flexhstu {version('flexhstu')}"


def test_an_existing_file_as_out_is_named_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert (
        _status(["train", "--data", "synthetic", "--out", str(tmp_path / "afile"), "--quiet", "--device", "cpu"]) == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"flexhstu train: error: --out: expected a folder, got {tmp_path / 'afile'} (a file)"
    )


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    # Ctrl-C during train: one line, not a traceback from inside torch.
    from flexhstu import train

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(train.loop, "train", interrupted)
    assert train.cli(["--data", "synthetic", "--quiet"]) == 130
    assert capsys.readouterr().err.strip() == "flexhstu train: interrupted"
