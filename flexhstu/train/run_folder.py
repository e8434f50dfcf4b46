"""The run's folder: ``--out``; else ``runs/latest`` on ``--resume``; else a new ``runs/<date>-<time>-<model>-<mask>``,
which ``runs/latest`` (a symlink, replaced atomically) points to once it holds an output. Rank 0 makes, checks and
locks it (``.lock``: one run per folder) and names it to the other ranks."""

from __future__ import annotations

import argparse
import fcntl
import itertools
import os
import time
from pathlib import Path

import torch.distributed as dist

RUNS = Path("runs")


def run_label(a: argparse.Namespace) -> str:
    """``<model>-<mask>`` of a run's folder name."""
    if a.model == "hstu":
        return f"hstu-{a.mask}"
    if a.model == "onerank":
        return "onerank-" + ("targets" if a.no_task_tokens else "tasktokens")
    return {"sasrec": "sasrec-causal", "popularity": "popularity"}[a.model]


def new_run_folder(a: argparse.Namespace, root: Path = RUNS) -> Path:
    """A fresh ``root/<date>-<time>-<model>-<mask>`` (``-2``, ``-3``... when runs start in the same second)."""
    root.mkdir(parents=True, exist_ok=True)
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{run_label(a)}"
    for n in itertools.count(1):
        out = root / (base if n == 1 else f"{base}-{n}")
        try:
            out.mkdir()
            return out
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def check_latest(root: Path = RUNS) -> Path:
    """``root/latest``, after checking that it is a symlink or absent (a run may replace it)."""
    link = root / "latest"
    if link.exists() and not link.is_symlink():
        raise ValueError(
            f"{link}: expected a symlink to the newest run, got a folder (written by an older "
            f"flexhstu); rename it (e.g. mv {link} {root}/old) or pass --out"
        )
    return link


def point_latest(out: Path, root: Path = RUNS) -> None:
    """Make ``root/latest`` a symlink to ``out``: a new link renamed over the old one, so readers never see
    a missing or half-made link."""
    link = check_latest(root)
    tmp = root / f".latest.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(out.name, tmp)  # relative: the runs folder can move
    os.replace(tmp, link)


_LOCKS: dict[Path, object] = {}  # the open lock files of this process's runs (train releases them at its end)

_LATEST_PENDING: set[Path] = set()  # new runs of this process that runs/latest does not point to yet


def lock_run(out: Path) -> None:
    """Hold ``out/.lock`` until ``unlock_run`` (or the process's end: a killed run leaves no stale lock), or raise
    if another run holds it: two runs writing one folder would leave the metrics of one beside the checkpoint of
    the other."""
    f = open(out / ".lock", "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(
            f"--out: expected a folder no other flexhstu train is writing, got {out} (another process "
            "holds its .lock; wait for it to end, or pass another --out)"
        ) from None
    _LOCKS[out] = f


def unlock_run(out: Path) -> None:
    f = _LOCKS.pop(out, None)
    if f is not None:
        f.close()  # closing the file releases its lock


def latest_after_output(out: Path, rank: int) -> None:
    """Point ``runs/latest`` at a new run once it holds an output: a run killed before its first checkpoint
    leaves ``runs/latest`` (and ``--resume``) on the run before it."""
    if rank == 0 and out in _LATEST_PENDING:
        point_latest(out)
        _LATEST_PENDING.discard(out)


def resolve_out(a: argparse.Namespace, rank: int, world: int) -> Path:
    """The run's folder: ``--out``; else ``runs/latest`` on ``--resume``; else a new folder that ``runs/latest``
    then points to. Rank 0 makes, checks and locks it and sends the other ranks its name, or the error that
    stopped it (so that they stop too, rather than wait for it in the first collective)."""
    shared: list = [None, None]  # the folder's name, rank 0's error
    if rank == 0:
        try:
            shared[0] = str(_claim_out(a))
        except (ValueError, OSError) as e:
            if world == 1:
                raise
            shared[1] = f"{e.strerror}: '{e.filename}'" if isinstance(e, OSError) and e.strerror else str(e)
    if world > 1:
        dist.broadcast_object_list(shared, src=0)
        if shared[1] is not None:
            raise ValueError(shared[1])
    return Path(shared[0])


def refuse_shared_folder(out: Path) -> None:
    """``--out`` naming a folder that holds much besides a run (a filesystem root, the home folder itself) is a
    slip (``--out /``, ``--out ~`` for ``~/run``): the run would scatter its files and .lock among the user's."""
    where = out.resolve()
    why = (
        "the filesystem root"
        if where == Path(where.anchor)
        else "the home folder itself"
        if where == Path.home().resolve()
        else None
    )
    if why:
        raise ValueError(f"--out: expected a folder of its own for the run (e.g. runs/NAME), got {out} ({why})")


def _claim_out(a: argparse.Namespace) -> Path:
    """``resolve_out`` on rank 0: the folder, made, checked (no other run in it) and locked."""
    if a.out is not None:
        out = Path(a.out)
        refuse_shared_folder(out)
    elif a.resume:
        latest = RUNS / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"--resume: expected {latest} (the newest run), no such run; pass --out FOLDER")
        out = latest.resolve()
    else:
        check_latest()  # before the run: it could not point runs/latest at its folder
        out = new_run_folder(a)
        _LATEST_PENDING.add(out)  # runs/latest moves once the run has written an output (latest_after_output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: expected a folder, got {out} (a file)")
    out.mkdir(parents=True, exist_ok=True)
    held = [f for f in ("checkpoint.pt", "metrics.json") if (out / f).exists()]
    if held and not a.resume:
        raise ValueError(
            f"--out: expected a folder without a run, got {out} holding {', '.join(held)} (pass "
            "--resume to continue it, or leave out --out for a new folder)"
        )
    lock_run(out)
    return out
