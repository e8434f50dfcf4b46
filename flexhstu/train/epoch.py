"""One training epoch: its batches (order and negatives from a generator seeded by (seed, epoch)), each step
split over the ranks, and ``Diverged`` at a loss or weight that is not finite; with the optimizer's parameter
groups and the weights' checksum."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import distributed
from ..models import make_batch
from ..models.ranking import collate
from ..nn import onerank_loss
from .run_report import Throughput
from .run_state import Progress
from .splits import Splits


def epoch_batches(a: argparse.Namespace, epoch: int, d: Splits) -> tuple[torch.Generator, list[list[int]]]:
    """The epoch's steps, ``--batch-size`` units each in an order drawn by a generator seeded by (seed, epoch);
    the generator then draws the negatives."""
    gen = torch.Generator().manual_seed(a.seed * 1000 + epoch)
    order = torch.randperm(len(d.units), generator=gen).tolist()
    batches = [order[i : i + a.batch_size] for i in range(0, len(order), a.batch_size)]
    return gen, batches[: a.steps_per_epoch] if a.steps_per_epoch else batches


def train_epoch(
    a: argparse.Namespace, epoch: int, d: Splits, model, ddp, opt, rank: int, world: int, device, speed: Throughput
) -> dict:
    """One epoch. Rank r trains on every world-th unit of each step, its mean loss weighted by its share of the
    step's targets (ranking: candidates) times the number of ranks, so DDP's mean gradient is the gradient of the
    whole step's mean loss: a retrieval run without dropout trains the same parameters on any number of ranks,
    up to float rounding. A rank left without a unit (a short last step) runs one with weight 0, as its
    collectives need it. The recorded loss is the mean over steps of the whole step's mean loss.

    ``Diverged`` stops it at the first step whose loss is not finite (on one rank at once; on several after the
    epoch, when every rank holds every step's loss, so that all stop together), and after the epoch if its last
    update left a weight that is not finite."""
    torch.manual_seed(a.seed * 1000 + epoch)  # dropout stream of this epoch
    gen, batches = epoch_batches(a, epoch, d)
    sharded = distributed.is_sharded(model)
    model.train()
    t0, tokens, losses = time.perf_counter(), 0, []
    bar = tqdm(batches, desc=f"epoch {epoch + 1}/{a.epochs}", disable=a.quiet or rank != 0, dynamic_ncols=True)
    for step in bar:
        start = time.perf_counter()
        idx = step[rank::world]
        share = float(d.weights[idx].sum()) / max(float(d.weights[step].sum()), 1.0) if idx else 0.0
        idx = idx or step[:1]
        if a.task == "retrieval":
            batch = make_batch([d.train_items[i] for i in idx], [d.seqs.times[i][:-2] for i in idx], a.max_len)
            batch = batch.to(device)
            loss = ddp(batch, a.negatives, gen)  # forward is the sampled-softmax loss
            step_tokens = batch.items.numel()
        else:
            b = collate(d.train_req, idx).to(device)
            loss = onerank_loss(ddp(*b.inputs()), b.labels, b.cand_offsets)
            step_tokens = b.hist_items.numel() + b.cand_items.numel() * model.group_size
        opt.zero_grad(set_to_none=True)
        (loss * (share * world) if world > 1 else loss).backward()
        if sharded:
            distributed.clip_grad_norm_(model.parameters(), 1.0, group=model.encoder.items.group)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item() * share if world > 1 else loss.item())
        if world == 1 and not math.isfinite(losses[-1]):
            bar.close()
            raise Diverged(epoch, len(losses), len(batches), f"the loss became {losses[-1]}")
        step_tokens = step_tokens if share > 0 or world == 1 else 0
        tokens += step_tokens
        speed.add(step_tokens, time.perf_counter() - start)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    if world > 1:  # each rank holds its share of every step's loss
        summed = torch.tensor(losses, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(summed)
        losses = summed.tolist()
        bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
        if bad is not None:
            raise Diverged(epoch, bad + 1, len(batches), f"the loss became {losses[bad]}")
    if not math.isfinite(checksum(model)):  # every rank: a sharded table's sum is collective
        raise Diverged(epoch, len(batches), len(batches), "the weights became non-finite in the update")
    return {"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": time.perf_counter() - t0}


class Diverged(Exception):
    """Training produced a non-finite loss or weight at (0-based) ``epoch``, 1-based ``step`` of ``steps``."""

    def __init__(self, epoch: int, step: int, steps: int, what: str):
        super().__init__(f"{what} at epoch {epoch + 1} step {step} of {steps}")
        self.epoch, self.step, self.steps, self.what = epoch, step, steps, what


def diverged_message(a: argparse.Namespace, e: Diverged, out: Path, p: Progress, knows_progress: bool) -> str:
    """The one line of a run stopped by ``e``: where, the learning rate, and what was kept (nothing of the
    diverged epoch is saved: the checkpoint, metrics.json and metrics.png stay as the last finite epoch left them)."""
    if a.no_checkpoint:
        kept = "nothing was saved (--no-checkpoint)"
    elif not knows_progress:
        kept = f"{out / 'checkpoint.pt'} keeps the last finite epoch, if one finished"
    elif p.epoch:
        kept = (
            f"{out / 'checkpoint.pt'} keeps epoch {p.epoch}, the last finite one (--resume with a lower --lr "
            "continues from it)"
        )
    else:
        kept = "no checkpoint was written (no epoch finished with finite weights)"
    return f"{e} with --lr {a.lr:g}: training diverged and stopped; {kept}"


def param_groups(a: argparse.Namespace, model: torch.nn.Module):
    """AdamW's parameters: one group (``--shard-embeddings none``, as always), else the dense parameters and the
    item table apart (on every number of ranks, so a sharded checkpoint resumes anywhere): a sharded table is a
    DTensor, which torch's multi-tensor kernels do not mix with plain tensors, and its group takes the fused
    kernel, which updates in place where the multi-tensor one would allocate a table-sized temporary."""
    if a.shard_embeddings == "none":
        return model.parameters()
    dense = [q for n, q in model.named_parameters() if n != "encoder.items.weight"]
    return [{"params": dense}, {"params": [model.encoder.items.weight], "fused": True}]


def checksum(model: torch.nn.Module) -> float:
    """The sum of every parameter (a sharded one summed over the ranks): equal on every rank of a healthy run."""
    total = 0.0
    for q in model.parameters():
        if hasattr(q, "to_local") and any(pl.is_shard() for pl in q.placements):
            part = q.to_local().detach().sum(dtype=torch.float64).reshape(1)
            dist.all_reduce(part, group=q.device_mesh.get_group())
            total += float(part)
        else:
            total += float((q.to_local() if hasattr(q, "to_local") else q).detach().sum(dtype=torch.float64))
    return total
