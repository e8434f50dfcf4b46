"""The run from start to end: the device, the data, the run's folder, the model (its item table whole or
sharded, DistributedDataParallel over the ranks), ``resume``; per epoch ``train_epoch``, validation and the
checkpoint; then the test at the best epoch and the outputs. ``cli`` is the command around it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import checkpoint, distributed
from ..cli.common import RunFailure, checked_device, output_files, run, user_input
from ..models import build_model
from .epoch import Diverged, checksum, diverged_message, param_groups, train_epoch
from .evaluation import evaluate, run_popularity, validation_score
from .options import DEFAULT_LR, check_cutoffs, model_config, parse
from .run_folder import latest_after_output, resolve_out, unlock_run
from .run_report import Throughput, write, written_metrics
from .run_state import Progress, resume, save_checkpoint
from .splits import Splits, prepare_data


def resolve_device(a: argparse.Namespace, rank: int) -> torch.device:
    device = checked_device(a.device)
    if device.type == "cuda":
        if device.index is None:
            local = int(os.environ.get("LOCAL_RANK", rank))
            device = torch.device(f"cuda:{local % torch.cuda.device_count()}")
        torch.cuda.set_device(device)  # NCCL and DeviceMesh use the current device
    return device


def build_item_table(a: argparse.Namespace, num_items: int, world: int, device) -> distributed.ItemTable:
    """The item table of ``--shard-embeddings`` after checking that its state fits every rank (one line naming
    the sizes, before anything is allocated); its rows depend only on ``--seed``."""
    rows = num_items + 1
    free = distributed.free_bytes(device)
    if world > 1:  # every rank decides on the smallest free memory, so all refuse or none
        t = torch.tensor([free], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        free = int(t)
    where = f"{device}" if world == 1 else f"the emptiest of {world} ranks ({device.type})"
    distributed.check_table_memory(rows, a.dim, a.shard_embeddings, world, free, where)
    return distributed.item_table(rows, a.dim, seed=a.seed, sharding=a.shard_embeddings, world=world, device=device)


def main(argv=None) -> dict:
    """Train and evaluate as ``argv`` says; returns what ``metrics.json`` holds. Input errors raise ``UserError``; a
    run that cannot finish (a non-finite loss, a file that cannot be written) raises ``RunFailure``."""
    return train(parse(argv))


def train(a: argparse.Namespace) -> dict:
    rank, world, created = distributed.setup()
    with user_input():
        device = resolve_device(a, rank)
    with user_input():  # before the run's folder: a data mistake leaves no empty run and runs/latest unmoved
        d = prepare_data(a)
        check_cutoffs(a, d.num_items)
    with user_input("--out"):
        out = resolve_out(a, rank, world)
    try:
        return _train_in(a, out, d, device, rank, world, created)
    finally:
        unlock_run(out)


def _train_in(a: argparse.Namespace, out: Path, d: Splits, device, rank: int, world: int, created: bool) -> dict:
    """The run in its (locked) folder ``out``."""
    torch.manual_seed(a.seed)
    result: dict = {"args": vars(a)}
    if a.model == "popularity":
        with output_files():
            return write(result | run_popularity(a, d), [], out, rank, a)

    with user_input():
        table = build_item_table(a, d.num_items, world, device)
    model = build_model(model_config(a), d.num_items, items=table).to(device)
    collective = table.sharded  # every rank reads a sharded table: all evaluate and save, rank 0 writes
    ddp = model
    if world > 1:
        if collective:  # the table's gradient reaches its owner through the lookup, not through DDP
            DDP._set_params_and_buffers_to_ignore_for_model(model, ["encoder.items.weight"])
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(param_groups(a, model), lr=a.lr if a.lr is not None else DEFAULT_LR, weight_decay=0.01)
    p = Progress()
    if a.resume:
        with user_input():
            p = resume(a, d, out, model, opt, device, rank)
    speed = Throughput()
    last = min(a.epochs, p.epoch + a.stop_after) if a.stop_after else a.epochs
    for epoch in range(p.epoch, last):
        try:
            record = train_epoch(a, epoch, d, model, ddp, opt, rank, world, device, speed)
        except Diverged as e:
            raise RunFailure(diverged_message(a, e, out, p, rank == 0 or collective)) from e
        if rank == 0 or collective:
            record.update({f"valid {k}": v for k, v in evaluate(a, model, d, "valid", device).items()})
            p.history.append(record)
            p.epoch = epoch + 1
            score = validation_score(a, record)
            new_best = score > p.best["score"]
            if new_best:
                p.best = {"score": score, "epoch": epoch + 1, "model": None}
            if not a.no_checkpoint:
                with output_files():
                    save_checkpoint(a, d, out, model, opt, p, new_best, rank)
                    latest_after_output(out, rank)
            if rank == 0 and not a.quiet:
                print(json.dumps(record))
        if world > 1:
            dist.barrier()
    if speed.steps:
        result["throughput"] = speed.report(world, device)
    elif "throughput" in (kept := written_metrics(out)):  # nothing trained here (a finished run's outputs
        result["throughput"] = kept["throughput"]  # written again): the report of the run that trained it stays
    elif world > 1:
        result["throughput"] = speed.report(world, device)
    if (rank == 0 or collective) and len(p.history) >= a.epochs:
        result["test_epoch"] = len(p.history)
        if p.best["epoch"] and not a.no_checkpoint:
            if p.best.get("dir"):
                with user_input():
                    checkpoint.load_sharded(out / p.best["dir"], model)
            elif p.best["model"] is not None:
                model.load_state_dict(p.best["model"])
            result["best_epoch"] = result["test_epoch"] = p.best["epoch"]
        result["test"] = evaluate(a, model, d, "test", device)
    if world > 1:
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checksum": checksum(model)}))
        dist.barrier()
    if created:
        dist.destroy_process_group()
    with output_files():
        return write(result, p.history, out, rank, a)


def cli(argv=None) -> int:
    """The command: exit status 0; 2 with one line on stderr for an input error; 1 with one line for a run that
    cannot finish (training diverged, a file could not be written)."""
    a = parse(argv)

    def command() -> int:
        train(a)
        return 0

    return run("flexhstu train", command, a.debug)
