"""What carries a run from one invocation to the next: ``Progress`` (the history, the epochs done, the best
epoch), the checkpoint saved after each epoch, and ``resume``, which reads it back after checking that it is
this run's (the settings of ``FIXED_ON_RESUME`` and the data's contents)."""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..run_settings import FIXED_ON_RESUME, saved_config
from .options import BUILTIN_DATA
from .splits import Splits


@dataclass
class Progress:
    """What a checkpoint carries besides the weights: per-epoch records, epochs done, the best validation epoch."""

    history: list[dict] = field(default_factory=list)
    epoch: int = 0
    best: dict = field(default_factory=lambda: {"score": -math.inf, "epoch": 0, "model": None})


def run_config(a: argparse.Namespace, d: Splits) -> dict:
    """What a checkpoint records of its run: the fixed arguments, the data's size, and --lr / --epochs."""
    return {
        **{k: getattr(a, k) for k in FIXED_ON_RESUME},
        "data_rows": d.data_rows,
        "num_items": d.num_items,
        "data_digest": d.digest,
        "lr": a.lr,
        "epochs": a.epochs,
    }


def resume(
    a: argparse.Namespace, d: Splits, out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, device, rank: int
) -> Progress:
    """Weights, optimizer and progress from ``out/checkpoint.pt`` (and the sharded folder it names), after checking
    that this run is the checkpoint's run. A sharded state is read into this run's sharding (any number of ranks)."""
    ckpt = out / "checkpoint.pt"
    if not ckpt.is_file():
        raise FileNotFoundError(
            f"--resume: expected a checkpoint at {ckpt}, no such file (leave out --resume to start a new run)"
        )
    state = checkpoint.load(ckpt, map_location=device)
    checkpoint.require(state, ckpt, "config", "epoch", "history", "best", *(() if "sharded" in state else ("opt",)))
    saved, now = saved_config(state, ckpt), run_config(a, d)
    was = {k: saved[k] for k in (*FIXED_ON_RESUME, "data_rows", "num_items", "data_digest")}
    files = was["data"] not in BUILTIN_DATA and now["data"] not in BUILTIN_DATA
    if files and Path(was["data"]).name == Path(now["data"]).name:
        # The same file name, maybe elsewhere (a moved or copied project; older runs recorded a relative path):
        # the data's contents (data_digest; before it was recorded, the size) decide. The checkpoint then records
        # the new path.
        was["data"] = now["data"]
    if was["data_digest"] is None:  # a checkpoint of an older flexhstu: data_rows and num_items compare
        was["data_digest"] = now["data_digest"]
    if was["model"] != "hstu":  # only hstu has a mask: older runs of other models recorded any --mask given
        was["mask"] = now["mask"]
    label = {"data_rows": "events in the data:", "num_items": "items in the data:"}  # not options: say what they are
    changed = [
        f"{label.get(k, '--' + k.replace('_', '-'))} {was[k]!r} in the checkpoint, {now[k]!r} now"
        for k in was
        if was[k] != now[k] and k != "data_digest"
    ]
    if was["data_digest"] != now["data_digest"] and not changed:
        changed = [f"--data {now['data']}: other contents than the run's data (same size; its events or ids differ)"]
    if d.duplicates and was["data_rows"] == now["data_rows"] + d.duplicates:
        changed.append(
            f"the data file holds {d.duplicates} duplicate events, which this flexhstu drops and the "
            "run (an older flexhstu) trained on"
        )
    if changed:
        raise ValueError(f"--resume: expected the run of {ckpt}, got a different one: " + "; ".join(changed))
    if "sharded" in state:
        checkpoint.load_sharded(out / state["sharded"], model, opt)
    else:
        checkpoint.load_weights(model, state.get("model"), ckpt)
        try:
            opt.load_state_dict(state["opt"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{ckpt}: the optimizer state does not fit the run's model ({e})") from e
    if a.lr is None:  # not given: the run keeps its learning rate and length
        a.lr = saved["lr"]
    if a.epochs is None:
        a.epochs = saved["epochs"]
    notes = []
    if saved["lr"] != a.lr:
        for group in opt.param_groups:
            group["lr"] = a.lr
        notes.append(f"--lr {a.lr} replaces the checkpoint's {saved['lr']}")
    if saved["epochs"] != a.epochs:
        notes.append(f"--epochs {a.epochs} replaces the checkpoint's {saved['epochs']} ({state['epoch']} done)")
    if rank == 0 and not a.quiet:  # --quiet: nothing but errors
        if state["epoch"] >= a.epochs:  # nothing left to train: the outputs are written again from the checkpoint
            print(
                f"flexhstu train: all {a.epochs} epochs are done in {ckpt} ({state['epoch']} trained); "
                "writing the run's outputs again (--epochs N for more)",
                file=sys.stderr,
            )
        else:
            print(f"flexhstu train: resuming at epoch {state['epoch'] + 1} of {a.epochs} from {ckpt}", file=sys.stderr)
        for note in notes:
            print(f"flexhstu train: resuming: {note}", file=sys.stderr)
    return Progress(state["history"], state["epoch"], state["best"])


def save_checkpoint(
    a: argparse.Namespace, d: Splits, out: Path, model, opt, p: Progress, new_best: bool, rank: int
) -> None:
    """``out/checkpoint.pt`` after an epoch. With ``--shard-embeddings none`` it holds the weights, the optimizer
    and the best epoch's weights (rank 0 writes it). Otherwise every rank writes its shards with
    torch.distributed.checkpoint to ``out/sharded/epoch-N`` (and ``best-N`` at a new best), and ``checkpoint.pt``,
    replaced last, names them; folders it no longer names are then deleted."""
    meta = {"config": run_config(a, d), "history": p.history, "epoch": p.epoch}
    if d.item_ids:
        meta.update(item_ids=d.item_ids, user_ids=d.user_ids)
    if a.shard_embeddings == "none":
        if new_best:
            p.best["model"] = copy.deepcopy(model.state_dict())
        checkpoint.save(
            {**meta, "model": model.state_dict(), "opt": opt.state_dict(), "best": p.best}, out / "checkpoint.pt"
        )
        return
    if new_best:
        p.best["dir"] = f"sharded/best-{p.epoch:04d}"
        checkpoint.save_sharded(out / p.best["dir"], model)
    state = f"sharded/epoch-{p.epoch:04d}"
    checkpoint.save_sharded(out / state, model, opt)
    if rank == 0:
        checkpoint.save({**meta, "sharded": state, "best": p.best}, out / "checkpoint.pt")
        checkpoint.remove_unreferenced(out / "sharded", {Path(state).name, Path(p.best.get("dir", "")).name})
    if dist.is_initialized():
        dist.barrier()
