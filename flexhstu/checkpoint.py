"""Training checkpoints: written atomically, loaded only when complete and made by flexhstu.

``save`` writes a temporary file in the checkpoint's folder, flushes and fsyncs it, renames it over
the checkpoint (``os.replace`` is atomic) and fsyncs the folder, so a crash at any moment leaves
either the previous checkpoint or the new one, never a truncated file. ``load`` refuses anything
without the format marker (a foreign or half-written file) with one error naming the file.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path

import torch

FORMAT = "flexhstu-checkpoint"
VERSION = 1


def save(state: dict, path: str | os.PathLike) -> None:
    """Write ``state`` (plus the format marker and version) to ``path`` atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, "version": VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself must reach the disk
    finally:
        os.close(folder)
    _remove_orphans(path)


def _remove_orphans(path: Path) -> None:
    """Delete temporary files that killed writers left beside ``path`` (their pid no longer runs).

    Files of live writers (another process saving to the same folder) are left alone.
    """
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        tmp.unlink(missing_ok=True)  # another writer may have removed it first


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def load(path: str | os.PathLike, map_location=None) -> dict:
    """The state written by ``save``; ``ValueError`` naming ``path`` if it is not a complete flexhstu checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected a flexhstu checkpoint, no such file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        first = str(e).strip().split(". ")[0].splitlines()[0][:100] if str(e).strip() else ""
        reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise ValueError(f"{path}: not a complete flexhstu checkpoint ({reason})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a complete flexhstu checkpoint (no '{FORMAT}' marker)")
    if state.get("version") != VERSION:
        raise ValueError(f"{path}: expected a flexhstu checkpoint of version {VERSION}, got version "
                         f"{state.get('version')}")
    return state
