"""Data files, training, resume and distributed training on small configurations."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import pytest
import torch
from children import check_child
from tiny_run import TINY as TINY_RUN

from flexhstu import train
from flexhstu.data import load, synthetic
from flexhstu.data.sequences import leave_one_out

TINY = TINY_RUN


def test_ratings_files_are_read_and_cached(tmp_path):
    dat = tmp_path / "ratings.dat"
    dat.write_text("1::10::5::100\n1::20::3::50\n2::10::4::70\n")
    d = load(str(dat), cache_dir=tmp_path / "cache")
    assert len(d) == 3 and d.num_items == 2 and sorted(d.item.tolist()) == [1, 1, 2]
    assert list((tmp_path / "cache").glob("*.parquet"))
    csv = tmp_path / "ratings.csv"
    csv.write_text("userId,movieId,rating,timestamp\n1,10,4.5,100\n")
    assert load(str(csv), cache_dir=tmp_path / "cache").rating.tolist() == [4.5]


@pytest.mark.parametrize(
    "content,msg",
    [
        ("", "expected interactions, got an empty file"),
        ("userId,movieId,timestamp\n1,2,3\n", r"missing \['rating'\]"),
        ("userId,movieId,rating,timestamp\n1,x,4,5\n", "line 2, column 'item': expected an integer, got 'x'"),
        ("userId,movieId,rating,timestamp\n", "expected interactions after the header"),
    ],
)
def test_bad_data_files_get_clear_errors(tmp_path, content, msg):
    f = tmp_path / "ratings.csv"
    f.write_text(content)
    with pytest.raises(ValueError, match=msg):
        load(str(f), cache_dir=tmp_path / "cache")


def test_unknown_data_and_extension_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data: expected ml-100k, synthetic or a ratings file"):
        load(str(tmp_path / "nope.csv"))
    f = tmp_path / "r.txt"
    f.write_text("1 2 3 4\n")
    with pytest.raises(ValueError, match=r"expected a .inter, .dat \(ML-1M\) or .csv"):
        load(str(f), cache_dir=tmp_path)


def test_leave_one_out_holds_out_the_last_two_events():
    seqs, valid, test = leave_one_out(synthetic(num_users=5, seed=3))
    for s, v, t in zip(seqs.items, valid, test):
        assert (v, t) == (s[-2], s[-1])


def test_a_tiny_retrieval_run_lowers_the_loss_and_beats_chance(tmp_path):
    r = train.main(TINY + ["--epochs", "3", "--out", str(tmp_path)])
    losses = [h["loss"] for h in r["history"]]
    assert losses[-1] < losses[0]
    assert r["test"]["HR@10"] > 0.1  # twice chance (10 / 200 items) on the planted next-item structure
    assert (tmp_path / "metrics.png").exists() and json.loads((tmp_path / "metrics.json").read_text())["test"]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = train.main(TINY + ["--epochs", "3", "--out", str(tmp_path / "a")])
    train.main(TINY + ["--epochs", "3", "--stop-after", "1", "--out", str(tmp_path / "b")])
    resumed = train.main(TINY + ["--epochs", "3", "--resume", "--out", str(tmp_path / "b")])
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"]]
    assert resumed["test"] == full["test"]


def test_tiny_ranking_runs_with_and_without_task_tokens(tmp_path):
    base = ["--task", "ranking", "--model", "onerank", "--epochs", "1"] + TINY
    with_tokens = train.main(base + ["--out", str(tmp_path / "t")])
    ablation = train.main(base + ["--no-task-tokens", "--metrics", "gauc,ndcg@3", "--out", str(tmp_path / "n")])
    tasks = ("watched", "rated>=4", "rated5")
    assert set(with_tokens["test"]) == {f"{m} {t}" for m in ("AUC", "NDCG@10") for t in tasks}
    assert set(ablation["test"]) == {f"{m} {t}" for m in ("AUC", "NDCG@10", "GAUC", "NDCG@3") for t in tasks}
    for r in (with_tokens, ablation):
        assert 0.0 <= r["test"]["AUC watched"] <= 1.0


SHORT = ["--epochs", "3", "--steps-per-epoch", "3", "--eval-users", "50"]


def test_a_diverging_run_stops_at_the_first_non_finite_loss_and_keeps_its_last_checkpoint(tmp_path, capsys):
    # Guards against: --lr 1e9 made every loss NaN, yet the run reported HR@10 = NDCG@10 = 1.0, chose a best epoch,
    # saved the NaN model and exited 0.
    out = tmp_path / "run"
    train.main(TINY + SHORT + ["--stop-after", "1", "--out", str(out)])
    before = {f: (out / f).read_bytes() for f in ("checkpoint.pt", "metrics.json", "metrics.png")}
    capsys.readouterr()
    assert train.cli(TINY + SHORT + ["--resume", "--lr", "1e9", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.fullmatch(
        r"flexhstu train: error: the loss became nan at epoch 2 step [23] of 3 with --lr 1e\+09: "
        r"training diverged and stopped; .*checkpoint\.pt keeps epoch 1, the last finite one "
        r"\(--resume with a lower --lr continues from it\)",
        err[0],
    ), err
    assert {f: (out / f).read_bytes() for f in before} == before  # nothing of the diverged epoch is written
    assert sorted(p.name for p in out.iterdir()) == [".lock", *sorted(before)]


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_a_run_that_diverges_in_its_first_epoch_writes_nothing(tmp_path, capsys, task):
    argv = ["--task", task, "--model", "onerank"] if task == "ranking" else []
    assert train.cli(TINY + SHORT + argv + ["--lr", "1e9", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        r"flexhstu train: error: the loss became nan at epoch 1 step \d of 3 with "
        r"--lr 1e\+09: training diverged and stopped; no checkpoint was written "
        r"\(no epoch finished with finite weights\)",
        err[0],
    ), err
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_weights_made_non_finite_by_an_epochs_last_update_are_never_saved(tmp_path, capsys, monkeypatch):
    step = torch.optim.AdamW.step

    def poisoning_step(self, *args, **kwargs):  # the update leaves an infinite weight; the loss stays finite
        out = step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = math.inf
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoning_step)
    assert train.cli(TINY + SHORT + ["--steps-per-epoch", "1", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "flexhstu train: error: the weights became non-finite in the update at epoch 1 step 1 of 1 with "
        "--lr 0.003: training diverged and stopped; no checkpoint was written (no epoch finished with "
        "finite weights)"
    ], err
    assert not (tmp_path / "checkpoint.pt").exists()


def test_two_cpu_processes_stay_in_sync(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: a local rendezvous on a free port, so parallel runs (or anything on a fixed port) cannot collide
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "flexhstu.train",
        *TINY,
        "--epochs",
        "1",
        "--out",
        str(tmp_path),
    ]
    check_child(cmd, env=env)  # on a failure, the message holds the ranks' output
    sums = [json.loads((tmp_path / f"rank{r}.json").read_text())["checksum"] for r in (0, 1)]
    assert sums[0] == sums[1]


def test_ml100k_is_read_from_the_recbole_wheel(tmp_path):
    d = load("ml-100k", cache_dir=tmp_path)
    assert (len(d), d.num_items, len(np.unique(d.user))) == (100_000, 1682, 943)
    assert set(np.unique(d.rating).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
