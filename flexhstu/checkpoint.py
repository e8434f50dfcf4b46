"""Training checkpoints: written atomically, loaded only when complete and made by flexhstu.

``save`` writes a temporary file in the checkpoint's folder, flushes and fsyncs it, renames it over
the checkpoint (``os.replace`` is atomic) and fsyncs the folder, so a crash at any moment leaves
either the previous checkpoint or the new one, never a truncated file. ``load`` refuses anything
without the format marker (a foreign or half-written file) with one error naming the file.

Sharded state (a model whose item table is split across ranks, and its optimizer) is written with
``torch.distributed.checkpoint`` (DCP): ``save_sharded`` writes every rank's shards into a temporary folder
(DCP fsyncs each file) and renames it into place once complete; ``load_sharded`` reads it into a model of
any sharding and any number of ranks (DCP reshards). The run's ``checkpoint.pt`` names the folders it
belongs to and is replaced last, so it is the commit point: a kill at any moment leaves the previous
``checkpoint.pt`` and the folders it names; ``remove_unreferenced`` deletes the rest after a commit.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "flexhstu-checkpoint"
VERSION = 1


def _umask() -> int:
    mask = os.umask(0o022)  # read by setting it; restored at once (module import, before any thread writes)
    os.umask(mask)
    return mask


_UMASK = _umask()


def save(state: dict, path: str | os.PathLike) -> None:
    """Write ``state`` (plus the format marker and version) to ``path`` atomically."""
    write_atomic(path, lambda f: torch.save({"format": FORMAT, "version": VERSION, **state}, f))


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, as ``save`` writes checkpoints (run outputs a user keeps,
    ``metrics.json``: a kill mid-write leaves the previous file, never half of one)."""
    write_atomic(path, lambda f: f.write(text.encode()))


def write_atomic(path: str | os.PathLike, write) -> None:
    """``write(f)`` into a temporary file beside ``path``, flushed and synced, then renamed over ``path``.

    If it fails, the temporary file is removed and ``path`` is as it was. A failure of the file system (a full
    disk, a file-size limit, a read-only folder) is raised as an ``OSError`` naming ``path`` with the system's
    error, whatever the writer made of it (``torch.save`` follows the OSError with a RuntimeError of its own)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        raise _naming(e, path) from e
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600: the mode a plain open would give (review)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        cause = _os_error(e)
        if cause is None:
            raise
        raise _naming(cause, path) from e
    _fsync_folder(path.parent)  # the rename itself must reach the disk
    _remove_orphans(path)


def _os_error(e: BaseException | None) -> OSError | None:
    """The first OSError in ``e``'s chain of causes and contexts (``e`` itself included)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _naming(e: OSError, path: Path) -> OSError:
    """``e`` as an OSError of the same kind about ``path`` (not the temporary file)."""
    return type(e)(e.errno, e.strerror or str(e), str(path)) if e.errno is not None else OSError(f"{path}: {e}")


def _fsync_folder(path: Path) -> None:
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _remove_orphans(path: Path) -> None:
    """Delete temporary files that killed writers left beside ``path`` (their pid no longer runs).

    Files of live writers (another process saving to the same folder) are left alone.
    """
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
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
        why = "a folder: pass the checkpoint.pt in it" if path.is_dir() else "no such file"
        raise FileNotFoundError(f"{path}: expected a flexhstu checkpoint, {why}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    # A foreign file can trip the weights-only unpickler anywhere (IndexError "pop from empty list" on a CSV).
    except (
        EOFError,
        RuntimeError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        ValueError,
        IndexError,
        KeyError,
        TypeError,
        AttributeError,
    ) as e:
        first = str(e).strip().split(". ")[0].splitlines()[0][:100] if str(e).strip() else ""
        reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise ValueError(f"{path}: not a complete flexhstu checkpoint ({reason})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a complete flexhstu checkpoint (no '{FORMAT}' marker)")
    if state.get("version") != VERSION:
        raise ValueError(
            f"{path}: expected a flexhstu checkpoint of version {VERSION}, got version {state.get('version')}"
        )
    return state


def require(state: dict, path: str | os.PathLike, *keys: str) -> None:
    """``ValueError`` naming ``path`` unless the loaded ``state`` holds every key (a checkpoint written by
    ``save`` with other contents: an interrupted development version, another tool)."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{path}: not a complete flexhstu run checkpoint (no '{missing[0]}' entry)")


def load_weights(module: torch.nn.Module, weights: object, path: str | os.PathLike) -> None:
    """``module.load_state_dict(weights)``; ``ValueError`` naming ``path`` when they do not fit (another model or
    configuration), never torch's multi-line report."""
    if not isinstance(weights, dict):
        raise ValueError(f"{path}: not a complete flexhstu run checkpoint (no weights)")
    try:
        module.load_state_dict(weights)
    except RuntimeError as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        detail = (lines[1] if len(lines) > 1 else lines[0] if lines else type(e).__name__)[:160]
        raise ValueError(f"{path}: the weights do not fit the run's model ({detail})") from e


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every save and load in one process (no process group), which is how one rank resumes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """The model's (and the optimizer's) state keyed by parameter names, shards as DTensors."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if opt is None:
        return {"model": get_model_state_dict(model)}
    model_state, opt_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": opt_state}


def save_sharded(folder: str | os.PathLike, model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Write ``model``'s state (and ``opt``'s) to the folder ``folder`` with torch.distributed.checkpoint, every
    rank its own shards. Collective: every rank calls it. The shards go to ``.NAME.tmp`` beside ``folder``,
    which is renamed to ``folder`` once every rank's files and DCP's metadata are written and synced; an
    existing ``folder`` is replaced (it must not be one that a committed ``checkpoint.pt`` names)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
        tmp.mkdir(parents=True)
    _barrier()
    with _single_process_ok():
        dcp.save(_state(model, opt), checkpoint_id=tmp, no_dist=not dist.is_initialized())  # each file fsynced
    _barrier()
    if rank == 0:
        _fsync_folder(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        _fsync_folder(folder.parent)
    _barrier()


def load_sharded(folder: str | os.PathLike, model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Read a ``save_sharded`` folder into ``model`` (and ``opt``), whatever their sharding and number of ranks.
    Collective. ``ValueError`` naming the folder if it is missing or incomplete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise ValueError(
            f"{folder}: expected a complete sharded checkpoint (torch.distributed.checkpoint "
            "folder with .metadata), got " + ("an incomplete folder" if folder.is_dir() else "no folder")
        )
    state = _state(model, opt)
    try:
        with _single_process_ok():
            dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    except Exception as e:  # DCP wraps every rank's failure in CheckpointException
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"{folder}: not a sharded checkpoint of this model ({first})") from e
    if opt is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def remove_unreferenced(folder: str | os.PathLike, keep: set[str]) -> None:
    """Delete the entries of ``folder`` whose names are not in ``keep`` (sharded states that no committed
    ``checkpoint.pt`` names, and temporary folders of killed runs). Run by one process after a commit."""
    folder = Path(folder)
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)
