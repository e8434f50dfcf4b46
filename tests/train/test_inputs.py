"""Training refuses what would silently change or void a run: bad sizes, a different run on --resume, no users."""

from __future__ import annotations

import pytest
from tiny_run import TINY as TINY_RUN

from flexhstu import checkpoint, run_settings, train
from flexhstu.cli.common import UserError
from flexhstu.data import synthetic

TINY = TINY_RUN


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
        (["--max-len", "0"], "argument --max-len: expected an integer >= 1, got 0"),
        (["--epochs", "0"], "argument --epochs: expected an integer >= 1, got 0"),
        (["--negatives", "0"], "argument --negatives: expected an integer >= 1, got 0"),
        (["--dim", "-8"], "argument --dim: expected an integer >= 1, got -8"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
        (["--stop-after", "-1"], "argument --stop-after: expected an integer >= 0, got -1"),
        (["--dropout", "1"], "argument --dropout: expected a probability in [0, 1), got 1.0"),
        (["--lr", "0"], "argument --lr: expected a finite number > 0, got 0.0"),
        (["--dim", "64", "--heads", "3"], "--heads: expected a divisor of --dim 64, got 3"),
    ],
)
def test_bad_sizes_are_argparse_errors(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        train.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"flexhstu train: error: {fragment}", err


def _ratings(tmp_path, events_per_user: int):
    f = tmp_path / "ratings.dat"
    # Each user's own items: a catalogue larger than the metrics' cut-off 10 (train.check_cutoffs).
    f.write_text(
        "".join(f"{u}::{u * events_per_user + i}::4::{i}\n" for u in range(5) for i in range(1, events_per_user + 1))
    )
    return str(f)


def test_retrieval_without_a_user_of_three_events_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    data = _ratings(tmp_path, 2)
    with pytest.raises(UserError, match=r"expected a user with 3 or more events .* got none; most events of a user: 2"):
        train.main(TINY[2:] + ["--data", data, "--out", str(tmp_path / "run")])


def test_ranking_without_an_eligible_user_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    data = _ratings(tmp_path, 10)
    with pytest.raises(UserError, match=r"ranking expected a user with 17 or more events"):
        train.main(
            ["--task", "ranking", "--model", "onerank"] + TINY[2:] + ["--data", data, "--out", str(tmp_path / "run")]
        )


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_a_data_cache_that_is_not_a_folder_names_flexhstu_cache(tmp_path, monkeypatch, capsys, where):
    # Guards against: FLEXHSTU_CACHE naming a file gave "error: File exists: '...'", which does not say what was wrong.
    blocker = tmp_path / "some.csv"
    blocker.write_text("a,b\n")
    cache = blocker if where == "file" else blocker / "cache"
    monkeypatch.setenv("FLEXHSTU_CACHE", str(cache))
    data = _ratings(tmp_path, 6)
    assert train.cli(TINY[2:] + ["--data", data, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    why = "a file" if where == "file" else "it cannot be made: Not a directory"
    assert err == [
        f"flexhstu train: error: FLEXHSTU_CACHE: expected a folder for the data cache, got '{cache}' ({why})"
    ], err


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train.main(TINY + ["--epochs", "3", "--stop-after", "1", "--out", str(out)])
    return out


def _copy(src, dst):
    dst.mkdir()
    (dst / "checkpoint.pt").write_bytes((src / "checkpoint.pt").read_bytes())
    return str(dst)


@pytest.mark.parametrize(
    "change,fragment",
    [
        (["--dim", "32"], "--dim 16 in the checkpoint, 32 now"),
        (["--seed", "1"], "--seed 0 in the checkpoint, 1 now"),
        (["--mask", "sla"], "--mask 'causal' in the checkpoint, 'sla' now"),
        (["--negatives", "8"], "--negatives 32 in the checkpoint, 8 now"),
    ],
)
def test_resume_refuses_a_run_that_changes_the_model_or_data(one_epoch, tmp_path, change, fragment):
    out = _copy(one_epoch, tmp_path / "r")
    with pytest.raises(UserError, match=r"--resume: expected the run of .* got a different one") as e:
        train.main(TINY + ["--epochs", "3", "--resume", "--out", out] + change)
    assert fragment in str(e.value)


def test_resume_refuses_other_data_behind_the_same_name(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    argv = TINY[2:] + ["--data", _ratings(tmp_path, 6), "--epochs", "3", "--out", str(tmp_path / "r")]
    train.main(argv + ["--stop-after", "1"])
    _ratings(tmp_path, 7)  # same name, other contents
    with pytest.raises(UserError, match="events in the data: 30 in the checkpoint, 35 now"):
        train.main(argv + ["--resume"])


def test_a_checkpoint_older_than_a_setting_resumes_with_the_settings_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    argv = TINY[2:] + ["--data", _ratings(tmp_path, 6), "--epochs", "2", "--out", str(tmp_path / "r")]
    train.main(argv + ["--stop-after", "1"])
    state = checkpoint.load(tmp_path / "r" / "checkpoint.pt")
    for key in (
        "synthetic_users",
        "synthetic_items",
        "synthetic_len",
        "steps_per_epoch",
        "eval_users",
        "shard_embeddings",
    ):
        del state["config"][key]  # as written before these settings existed
    checkpoint.save(state, tmp_path / "r" / "checkpoint.pt")
    assert [h["epoch"] for h in train.main(argv + ["--resume"])["history"]] == [1, 2]
    with pytest.raises(UserError, match="--eval-users 0 in the checkpoint, 5 now"):
        train.main(argv + ["--resume", "--eval-users", "5"])


def test_a_setting_added_later_reads_in_an_older_checkpoint_as_the_options_default():
    # saved_config fills such a setting from run_settings.BEFORE_ADDED, not from the parser: a default changed
    # later must keep the old value there, or older runs would resume as runs they never were.
    later = [k for k in run_settings.FIXED_ON_RESUME if k not in run_settings.CONFIG_ALWAYS_RECORDED]
    parser = train.build_parser()
    assert {k: parser.get_default(k) for k in later} == run_settings.BEFORE_ADDED


def test_a_checkpoint_whose_configuration_lacks_a_key_is_named_alike_by_resume_and_recommend(
    one_epoch, tmp_path, capsys
):
    # Guards against: recommend said "its configuration lacks 'Namespace' object has no attribute 'dim'" while
    # train --resume accepted the same file without a word.
    from flexhstu.cli.main import main

    out = tmp_path / "r"
    _copy(one_epoch, out)
    ckpt = out / "checkpoint.pt"
    state = checkpoint.load(ckpt)
    del state["config"]["dim"]
    checkpoint.save(state, ckpt)
    want = f"error: {ckpt}: not a complete flexhstu run checkpoint (its configuration lacks 'dim')"
    capsys.readouterr()
    assert train.cli(TINY + ["--epochs", "3", "--resume", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"flexhstu train: {want}"]
    assert main(["recommend", "--checkpoint", str(ckpt), "--users", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"flexhstu recommend: {want}"]


def test_resume_applies_a_new_learning_rate_and_more_epochs(one_epoch, tmp_path, capsys):
    out = _copy(one_epoch, tmp_path / "r")
    loud = [x for x in TINY if x != "--quiet"]  # the notes go to stderr unless --quiet
    r = train.main(loud + ["--epochs", "2", "--stop-after", "1", "--lr", "0.001", "--resume", "--out", out])
    err = capsys.readouterr().err
    assert "flexhstu train: resuming: --lr 0.001 replaces the checkpoint's 0.003" in err
    assert "flexhstu train: resuming: --epochs 2 replaces the checkpoint's 3 (1 done)" in err
    state = checkpoint.load(tmp_path / "r" / "checkpoint.pt")
    assert [g["lr"] for g in state["opt"]["param_groups"]] == [0.001]
    assert state["config"]["lr"] == 0.001 and state["epoch"] == 2 and "test" in r


def test_resume_keeps_the_runs_learning_rate_and_length_unless_given(one_epoch, tmp_path, capsys):
    # Guards against: a resume without --lr put the learning rate back to the default (and --epochs to 60).
    out = _copy(one_epoch, tmp_path / "r")
    train.main(TINY + ["--stop-after", "1", "--lr", "0.001", "--resume", "--out", out])
    capsys.readouterr()
    train.main([x for x in TINY if x != "--quiet"] + ["--stop-after", "1", "--resume", "--out", out])
    err = capsys.readouterr().err
    assert "flexhstu train: resuming at epoch 3 of 3" in err and "replaces" not in err, err
    state = checkpoint.load(tmp_path / "r" / "checkpoint.pt")
    assert [g["lr"] for g in state["opt"]["param_groups"]] == [0.001]
    assert state["config"]["lr"] == 0.001 and state["config"]["epochs"] == 3 and state["epoch"] == 3


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(UserError, match=r"--resume: expected a checkpoint at .*checkpoint\.pt, no such file"):
        train.main(TINY + ["--resume", "--out", str(tmp_path)])


def _events_csv(tmp_path):
    d = synthetic(num_users=40, num_items=30, length=8)
    f = tmp_path / "events.csv"
    rows = (f"{t},user-{u},item-{i}\n" for u, i, t in zip(d.user, d.item, d.timestamp))
    f.write_text("when,who,what\n" + "".join(rows))
    return str(f)


def test_a_csv_of_string_ids_trains_through_a_column_mapping(tmp_path):
    r = train.main(
        [
            "--model",
            "popularity",
            "--data",
            _events_csv(tmp_path),
            "--columns",
            "user=who,item=what,time=when",
            "--out",
            str(tmp_path / "run"),
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    assert 0.0 <= r["test"]["HR@10"] <= 1.0 and r["args"]["columns"] == {"user": "who", "item": "what", "time": "when"}


def test_a_missing_mapped_column_is_one_line_naming_the_file(tmp_path, capsys):
    data = _events_csv(tmp_path)
    status = train.cli(
        [
            "--model",
            "popularity",
            "--data",
            data,
            "--columns",
            "user=who,item=film,time=when",
            "--out",
            str(tmp_path / "run"),
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [
        f"flexhstu train: error: {data}: expected column 'film' (--columns item=film), "
        "missing (found ['when', 'who', 'what'])"
    ], err


def test_a_bad_column_mapping_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        train.parse(["--columns", "user=who,item=what"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "flexhstu train: error: argument --columns: expected user, item and time (rating is optional), missing time"
    )


def test_a_relative_data_path_resumes_and_recommends_from_another_directory(tmp_path, monkeypatch):
    # A run recorded --data as typed: from another directory, --resume and recommend read another file or none.
    from flexhstu.recommend import Recommender

    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _ratings(tmp_path / "a", 6)
    monkeypatch.chdir(tmp_path / "a")
    argv = TINY[2:] + ["--data", "ratings.dat", "--epochs", "2", "--out", str(tmp_path / "r")]
    train.main(argv + ["--stop-after", "1"])
    assert checkpoint.load(tmp_path / "r" / "checkpoint.pt")["config"]["data"] == str(tmp_path / "a" / "ratings.dat")
    monkeypatch.chdir(tmp_path / "b")
    # Same name and size here, other users: read instead, user "0" would be unknown.
    (tmp_path / "b" / "ratings.dat").write_text((tmp_path / "a" / "ratings.dat").read_text().replace("\n", "\n1")[:-1])
    history = train.main(
        TINY[2:] + ["--data", "../a/ratings.dat", "--epochs", "2", "--resume", "--out", str(tmp_path / "r")]
    )["history"]
    assert [h["epoch"] for h in history] == [1, 2]
    rec = Recommender.from_checkpoint(tmp_path / "r" / "checkpoint.pt")
    assert len(rec.recommend(["0"], k=3)[0].items) == 3


def _copied_project(tmp_path, monkeypatch) -> list[str]:
    """A project p1 with one epoch of a two-epoch run on its ratings.dat, copied to p2 (the working directory
    now); returns the run's arguments."""
    import shutil

    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    (tmp_path / "p1").mkdir()
    _ratings(tmp_path / "p1", 6)
    monkeypatch.chdir(tmp_path / "p1")
    argv = TINY[2:] + ["--data", "ratings.dat", "--epochs", "2", "--out", "runs/r"]
    train.main(argv + ["--stop-after", "1"])
    shutil.copytree(tmp_path / "p1", tmp_path / "p2")
    monkeypatch.chdir(tmp_path / "p2")
    return argv


def test_a_moved_project_resumes_on_its_data_file_there(tmp_path, monkeypatch):
    # Review: recording the absolute path must not refuse a project copied elsewhere (same file name and size);
    # another file name is still another run.
    argv = _copied_project(tmp_path, monkeypatch)
    (tmp_path / "p2" / "other.dat").write_text((tmp_path / "p2" / "ratings.dat").read_text())
    with pytest.raises(UserError, match=r"--data '.*/p1/ratings.dat' in the checkpoint, '.*/p2/other.dat' now"):
        train.main(TINY[2:] + ["--data", "other.dat", "--epochs", "2", "--resume", "--out", "runs/r"])
    assert [h["epoch"] for h in train.main(argv + ["--resume"])["history"]] == [1, 2]
    assert checkpoint.load(tmp_path / "p2" / "runs" / "r" / "checkpoint.pt")["config"]["data"] == str(
        tmp_path / "p2" / "ratings.dat"
    )


def test_same_sized_data_with_other_contents_is_refused_on_resume_and_recommend(tmp_path, monkeypatch):
    # Audit: a copy of the project whose data file was relabelled (same name, same size) resumed on it, and
    # recommend answered for the wrong users.
    from flexhstu.recommend import Recommender

    argv = _copied_project(tmp_path, monkeypatch)
    lines = (tmp_path / "p2" / "ratings.dat").read_text().splitlines(True)
    relabelled = "".join(f"{4 - int(u)}::{rest}" for u, _, rest in (line.partition("::") for line in lines))
    (tmp_path / "p2" / "ratings.dat").write_text(relabelled)
    with pytest.raises(
        UserError,
        match=r"--resume: expected the run of .*: --data .*/p2/ratings.dat: other contents "
        r"than the run's data \(same size",
    ):
        train.main(argv + ["--resume"])
    with pytest.raises(
        ValueError,
        match=r"--data ratings.dat: expected the run's data, got other contents of the "
        "same size",
    ):
        Recommender.from_checkpoint(tmp_path / "p2" / "runs" / "r" / "checkpoint.pt", data="ratings.dat")
    assert Recommender.from_checkpoint(tmp_path / "p1" / "runs" / "r" / "checkpoint.pt").recommend(["0"], k=2)


def test_a_synthetic_run_of_other_sizes_recommends(tmp_path):
    # Audit: recommend rebuilt --data synthetic at its default sizes and refused the run's own data.
    from flexhstu.recommend import Recommender

    train.main(TINY + ["--synthetic-users", "50", "--synthetic-items", "30", "--epochs", "1", "--out", str(tmp_path)])
    answer = Recommender.from_checkpoint(tmp_path / "checkpoint.pt").recommend([3], k=4)[0]
    assert len(answer.items) == 4 and set(answer.items) <= set(range(1, 31))


def test_a_run_trained_on_duplicate_events_is_told_why_it_no_longer_resumes(tmp_path, monkeypatch):
    # Review: a run of an older flexhstu trained on a file's duplicate events, which are now dropped; --resume
    # said only "--data-rows 32 in the checkpoint, 30 now".
    monkeypatch.setenv("FLEXHSTU_CACHE", str(tmp_path / "cache"))
    data = _ratings(tmp_path, 6)
    argv = TINY[2:] + ["--data", data, "--epochs", "2", "--out", str(tmp_path / "r")]
    train.main(argv + ["--stop-after", "1"])
    lines = (tmp_path / "ratings.dat").read_text().splitlines(True)
    (tmp_path / "ratings.dat").write_text("".join(lines + lines[:2]))  # as the older run read it
    state = checkpoint.load(tmp_path / "r" / "checkpoint.pt")
    state["config"].update(data_rows=len(lines) + 2, data_digest=None)
    ckpt = tmp_path / "r" / "checkpoint.pt"
    checkpoint.save({k: v for k, v in state.items() if k not in ("format", "version")}, ckpt)
    with pytest.raises(
        UserError,
        match=rf"events in the data: {len(lines) + 2} in the checkpoint, {len(lines)} now; "
        "the data file holds 2 duplicate events, which this flexhstu drops",
    ):
        train.main(argv + ["--resume"])
