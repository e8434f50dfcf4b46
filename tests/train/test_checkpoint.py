"""Checkpoints survive a kill at any moment and refuse files that are not complete flexhstu checkpoints."""

from __future__ import annotations

import errno
import os
import pickle
import random
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from children import run_child, shown
from tiny_run import TINY as TINY_RUN

from flexhstu import checkpoint, train

TINY = TINY_RUN

# Re-saves the run's checkpoint with a large payload tagged by a version number, forever.
SAVER = """
import sys, torch
from flexhstu import checkpoint
path = sys.argv[1]
state = checkpoint.load(path)
for version in range(10**9):
    state["pad"] = torch.full((8 * 2**20,), version, dtype=torch.int32)  # 32 MiB
    state["pad_version"] = version
    checkpoint.save(state, path)
    print(version, flush=True)
"""


def test_a_checkpoint_killed_mid_save_is_a_complete_version_and_resumes(tmp_path):
    out = tmp_path / "run"
    train.main(TINY + ["--epochs", "2", "--stop-after", "1", "--out", str(out)])
    ckpt = out / "checkpoint.pt"
    rng = random.Random(0)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(ckpt)], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # one save done: the next ones overwrite a complete checkpoint
        time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = checkpoint.load(ckpt)
        v = state["pad_version"]
        assert torch.equal(state["pad"], torch.full_like(state["pad"], v))
        assert state["epoch"] == 1
    resumed = train.main(TINY + ["--epochs", "2", "--resume", "--out", str(out)])
    assert [h["epoch"] for h in resumed["history"]] == [1, 2] and resumed["test"]


def test_save_leaves_the_previous_checkpoint_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save({"epoch": 1}, path)

    def broken(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save({"epoch": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # the temporary file is gone


def _write_truncated(p):
    checkpoint.save({"epoch": 1, "w": torch.randn(1000)}, p)
    p.write_bytes(p.read_bytes()[:3000])


@pytest.mark.parametrize(
    "make",
    [
        lambda p: p.write_bytes(b""),
        _write_truncated,
        lambda p: p.write_bytes(b"not a checkpoint at all"),
        lambda p: p.write_bytes(pickle.dumps({"epoch": 1}, protocol=2)),  # torch.load's protocol: no warning
        lambda p: torch.save({"epoch": 1}, p),
        # A CSV of events: the weights-only unpickler fails with IndexError (guards against: a traceback).
        lambda p: p.write_text("uid,iid,ts,r\n" + "".join(f"u0,i{i % 40},{1000 + i},{i % 5 + 1}\n" for i in range(50))),
    ],
    ids=["empty", "truncated", "garbage", "foreign-pickle", "foreign-torch", "csv"],
)
def test_incomplete_or_foreign_checkpoints_get_one_clear_error(tmp_path, make):
    path = tmp_path / "checkpoint.pt"
    make(path)
    with pytest.raises(ValueError, match=f"{path}: not a complete flexhstu checkpoint"):
        checkpoint.load(path)


def test_a_checkpoint_of_another_version_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": checkpoint.FORMAT, "version": 99}, path)
    with pytest.raises(ValueError, match="expected a flexhstu checkpoint of version 1, got version 99"):
        checkpoint.load(path)


def test_temporary_files_of_killed_writers_are_removed_and_live_ones_kept(tmp_path):
    path = tmp_path / "checkpoint.pt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f".checkpoint.pt.{dead.pid}.abc.tmp"
    live = tmp_path / f".checkpoint.pt.{os.getppid()}.def.tmp"  # the parent process is alive
    orphan.write_bytes(b"half")
    live.write_bytes(b"in flight")
    checkpoint.save({"epoch": 1}, path)
    assert not orphan.exists() and live.exists()
    assert checkpoint.load(path)["epoch"] == 1


def test_metrics_and_checkpoints_get_the_mode_a_plain_write_would(tmp_path):
    # Review: mkstemp's 0600 made metrics.json unreadable to the group of a shared run folder.
    mask = os.umask(0o022)
    os.umask(mask)
    checkpoint.write_text(tmp_path / "metrics.json", "{}")
    checkpoint.save({"epoch": 1}, tmp_path / "checkpoint.pt")
    for name in ("metrics.json", "checkpoint.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask


SHORT = ["--epochs", "3", "--steps-per-epoch", "2", "--eval-users", "50"]


def _run_files(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_a_checkpoint_that_outgrows_the_file_size_limit_is_one_line_and_the_previous_one_stays(tmp_path):
    # Guards against (ulimit -f 2000; flexhstu train --resume): two chained tracebacks, OSError [Errno 27] File too
    # large, then torch's RuntimeError from inline_container.cc.
    out = tmp_path / "run"
    train.main(TINY + SHORT + ["--stop-after", "1", "--out", str(out)])
    before = _run_files(out)
    limit = len(before["checkpoint.pt"]) // 2  # below a checkpoint, above the other files

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = run_child(
        [sys.executable, "-m", "flexhstu.train", *TINY, *SHORT, "--resume", "--out", str(out)], preexec_fn=small_files
    )
    assert done.returncode == 1, shown(done)
    assert done.stderr.strip().splitlines() == [
        f"flexhstu train: error: could not write {out}/checkpoint.pt: File too large (EFBIG); the previous "
        "checkpoint.pt, if any, is kept whole"
    ], shown(done)
    assert _run_files(out) == before  # the checkpoint of epoch 1 is intact, and no temporary file is left
    assert checkpoint.load(out / "checkpoint.pt")["epoch"] == 1


@pytest.mark.parametrize("name", ["metrics.json", "metrics.png"])
def test_run_outputs_that_cannot_be_written_are_one_line_and_the_previous_ones_stay(
    tmp_path, monkeypatch, capsys, name
):
    out = tmp_path / "run"
    train.main(TINY + SHORT + ["--stop-after", "1", "--out", str(out)])
    before = _run_files(out)
    real = checkpoint.write_atomic

    class Full:  # a file on a full disk: the first bytes go in, then the writes fail
        def __init__(self, f):
            self.f, self.left = f, 64

        def write(self, data):
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= len(data)
            return self.f.write(data)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    def full_disk(path, write):
        if os.path.basename(path) != name:
            return real(path, write)
        return real(path, lambda f: write(Full(f)))

    monkeypatch.setattr(checkpoint, "write_atomic", full_disk)
    capsys.readouterr()
    assert train.cli(TINY + SHORT + ["--resume", "--stop-after", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"flexhstu train: error: could not write {out}/{name}: No space left on device (ENOSPC); the "
        f"previous {name}, if any, is kept whole"
    ], err
    after = _run_files(out)
    assert after[name] == before[name] and sorted(after) == sorted(before)  # no temporary file is left
