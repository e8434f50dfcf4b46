"""Each run has its own folder; runs/latest follows the newest; --resume without --out continues it."""

from __future__ import annotations

import json
import os

import pytest
from tiny_run import TINY_MODEL

from flexhstu import train
from flexhstu.cli.common import UserError

TINY = ["--data", "synthetic", *TINY_MODEL]


def test_each_run_gets_its_own_folder_and_latest_points_to_the_newest(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    train.main(["--model", "popularity", "--data", "synthetic", "--device", "cpu"])
    train.main(["--model", "popularity", "--data", "synthetic", "--metrics", "mrr", "--device", "cpu"])
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and all("-popularity" in p.name for p in runs)  # -2 when both start in one second
    assert os.readlink(tmp_path / "runs" / "latest") == runs[1].name  # relative, to the newest
    first, second = (json.loads((p / "metrics.json").read_text()) for p in runs)
    assert "MRR" not in first["test"] and "MRR" in second["test"]  # nothing mixed between the runs
    assert f"flexhstu train: wrote {runs[1].relative_to(tmp_path)}/ (metrics.json)" in capsys.readouterr().out


def test_resume_without_out_continues_the_latest_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    train.main(TINY + ["--epochs", "2", "--stop-after", "1", "--quiet"])
    run = (tmp_path / "runs" / "latest").resolve()
    result = train.main(TINY + ["--epochs", "2", "--resume"])
    captured = capsys.readouterr()
    assert f"flexhstu train: resuming at epoch 2 of 2 from {run / 'checkpoint.pt'}" in captured.err
    assert (
        f"wrote {run}/ (checkpoint.pt, metrics.json, metrics.png); best epoch {result['best_epoch']} of 2"
        in captured.out
    )
    assert [p.name for p in (tmp_path / "runs").iterdir() if not p.is_symlink()] == [run.name]


def test_resuming_a_finished_run_says_nothing_is_left_to_train(tmp_path, capsys):
    train.main(TINY + ["--epochs", "1", "--quiet", "--out", str(tmp_path)])
    train.main(TINY + ["--epochs", "1", "--out", str(tmp_path), "--resume"])
    err = capsys.readouterr().err
    assert f"flexhstu train: all 1 epochs are done in {tmp_path / 'checkpoint.pt'} (1 trained)" in err
    assert "resuming at epoch" not in err
    train.main(TINY + ["--epochs", "1", "--quiet", "--out", str(tmp_path), "--resume"])
    assert capsys.readouterr().err == ""  # --quiet: nothing but errors (guards against: the notes were printed)


def test_writing_a_finished_runs_outputs_again_keeps_its_throughput(tmp_path):
    # Audit: resuming a finished run (nothing left to train) wrote metrics.json again without its "throughput".
    first = json.loads(json.dumps(train.main(TINY + ["--epochs", "1", "--quiet", "--out", str(tmp_path)])))
    again = train.main(TINY + ["--epochs", "1", "--quiet", "--out", str(tmp_path), "--resume"])
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert first["throughput"]["steps"] > 0 and written["throughput"] == again["throughput"] == first["throughput"]
    assert written["test"] == first["test"]


def test_a_folder_that_holds_a_run_is_refused_without_resume(tmp_path):
    train.main(["--model", "popularity", "--data", "synthetic", "--device", "cpu", "--quiet", "--out", str(tmp_path)])
    with pytest.raises(
        UserError,
        match=rf"--out: expected a folder without a run, got {tmp_path} holding "
        r"metrics.json \(pass --resume",
    ):
        train.main(
            ["--model", "popularity", "--data", "synthetic", "--device", "cpu", "--quiet", "--out", str(tmp_path)]
        )


def test_resume_without_any_run_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"--resume: expected runs/latest \(the newest run\), no such run"):
        train.main(TINY + ["--resume", "--quiet"])


def test_a_latest_folder_of_an_older_version_is_not_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    with pytest.raises(UserError, match=r"runs/latest: expected a symlink to the newest run, got a folder"):
        train.main(["--model", "popularity", "--data", "synthetic", "--device", "cpu", "--quiet"])


def test_the_plot_is_titled_and_puts_a_ranking_metrics_tasks_in_one_panel(tmp_path):
    from PIL import Image

    a = train.parse(
        ["--task", "ranking", "--model", "onerank", "--no-task-tokens", "--data", "/x/events.csv", "--seed", "3"]
    )
    assert train.plot_title(a) == "onerank (targets mask) on events.csv, seed 3"
    assert (
        train.plot_title(train.parse(["--mask", "sla", "--sla-k1", "8"])) == "hstu (SLA k1=8 k2=4) on ml-100k, seed 0"
    )
    tasks = ("watched", "rated>=4", "rated5")
    history = [
        {
            "epoch": e,
            "loss": 1.0 / e,
            **{f"valid {m} {t}": 0.5 for m in ("AUC", "NDCG@10", "GAUC") for t in tasks},
            "seconds": 1.0,
        }
        for e in (1, 2, 3)
    ]
    train.plot(history, tmp_path / "m.png", "title", best_epoch=2)
    assert Image.open(tmp_path / "m.png").size == (1520, 340)  # one row: loss, AUC, NDCG@10, GAUC


@pytest.mark.parametrize(
    "argv", [["--data", "no/such/ratings.dat"], ["--data", "synthetic", "--columns", "user=a,item=b,time=c"]]
)
def test_a_data_mistake_leaves_no_run_folder_and_latest_where_it_was(tmp_path, monkeypatch, argv):
    # Guards against: the failed run's empty folder took runs/latest, hiding the good run from recommend and --resume.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "good").mkdir(parents=True)
    os.symlink("good", tmp_path / "runs" / "latest")
    with pytest.raises(UserError):
        train.main(argv + ["--quiet", "--device", "cpu"])
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["good", "latest"]
    assert os.readlink(tmp_path / "runs" / "latest") == "good"


def test_two_runs_in_one_folder_at_once_are_refused(tmp_path, capsys):
    # Audit: two trains with one --out wrote into each other's files (the metrics of one, the checkpoint of the
    # other). The lock is an open file's flock: another open of .lock in this process stands for another run.
    out = tmp_path / "run"
    out.mkdir()
    train.lock_run(out)
    try:
        status = train.cli(TINY + ["--epochs", "1", "--quiet", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and err == [
            f"flexhstu train: error: --out: expected a folder no other flexhstu train is "
            f"writing, got {out} (another process holds its .lock; wait for it to end, or "
            "pass another --out)"
        ], err
        assert not (out / "metrics.json").exists()
    finally:
        train.unlock_run(out)
    assert train.cli(TINY + ["--epochs", "1", "--quiet", "--out", str(out)]) == 0  # released: the run goes on
    assert train.cli(TINY + ["--epochs", "1", "--quiet", "--out", str(out), "--resume"]) == 0  # released at its end


def test_a_run_killed_before_its_first_output_leaves_latest_on_the_run_before(tmp_path, monkeypatch):
    # Audit: runs/latest moved when the folder was made, so `--resume` after a kill in epoch 1 found no checkpoint.
    monkeypatch.chdir(tmp_path)
    train.main(TINY + ["--epochs", "2", "--stop-after", "1", "--quiet"])
    good = os.readlink(tmp_path / "runs" / "latest")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train.loop, "train_epoch", killed)
        with pytest.raises(KeyboardInterrupt):
            train.main(TINY + ["--epochs", "2", "--quiet"])
    assert len([p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]) == 2
    assert os.readlink(tmp_path / "runs" / "latest") == good
    assert [h["epoch"] for h in train.main(TINY + ["--epochs", "2", "--resume", "--quiet"])["history"]] == [1, 2]
    before = {p.name for p in (tmp_path / "runs").iterdir()}
    train.main(TINY + ["--epochs", "1", "--quiet", "--no-checkpoint"])  # its only output: metrics.json, at the end
    (new,) = {p.name for p in (tmp_path / "runs").iterdir()} - before
    assert os.readlink(tmp_path / "runs" / "latest") == new


def test_metrics_json_holds_null_for_a_metric_that_is_not_a_number(tmp_path):
    # Audit: json.dumps wrote a bare NaN, which jq and JSON.parse refuse.
    a = train.parse(TINY + ["--quiet", "--out", str(tmp_path)])
    train.write({"test": {"AUC": float("nan"), "HR@10": 0.5, "per": [float("inf"), 1.0]}}, [], tmp_path, 0, a)

    def no_constants(name):
        raise AssertionError(f"metrics.json holds {name}")

    saved = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=no_constants)
    assert saved["test"] == {"AUC": None, "HR@10": 0.5, "per": [None, 1.0]}


def test_the_plot_is_written_atomically(tmp_path, monkeypatch):
    # Guards against: a kill while metrics.png was written left an empty file (savefig wrote in place).
    from flexhstu import checkpoint

    seen = []
    real = checkpoint.write_atomic
    monkeypatch.setattr(checkpoint, "write_atomic", lambda path, write: (seen.append(path.name), real(path, write)))
    train.plot(
        [{"epoch": 1, "loss": 1.0, "valid HR@10": 0.1, "valid NDCG@10": 0.05}], tmp_path / "metrics.png", "title", 1
    )
    assert seen == ["metrics.png"] and (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("where", ["root", "home"])
def test_a_filesystem_root_or_the_home_folder_is_refused_as_out(tmp_path, monkeypatch, capsys, where):
    # Guards against: --out / was accepted and wrote the run (checkpoint.pt, metrics.json, .lock...) into /.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()

    def claimed(out):  # were the folder accepted, nothing may be written into / here
        raise AssertionError(f"the run claimed {out}")

    monkeypatch.setattr(train.run_folder, "lock_run", claimed)
    out = "/" if where == "root" else str(tmp_path / "home" / ".." / "home")
    assert train.cli(TINY + ["--epochs", "1", "--steps-per-epoch", "1", "--out", out]) == 2
    why = "the filesystem root" if where == "root" else "the home folder itself"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"flexhstu train: error: --out: expected a folder of its own for the run (e.g. runs/NAME), got {out} ({why})"
    ]
    assert list((tmp_path / "home").iterdir()) == []
