"""``flexhstu train`` / ``torchrun --nproc-per-node N -m flexhstu.train``: train and evaluate a model.

Retrieval (next item, leave-one-out: last event test, second-to-last validation): HSTU (causal or
SLA), a SASRec-style baseline, popularity; HR@10 and NDCG@10 by full-corpus ranking (items the
user has seen are excluded). Ranking (OneRank, or the ablation without task tokens): AUC per task
and NDCG@10 within each candidate list.

Test metrics are those of the epoch with the best validation score (NDCG@10 for retrieval, mean
AUC for ranking). Every epoch's order and negatives come from generators seeded by (seed, epoch),
so resuming from a checkpoint reproduces the uninterrupted run. Under torchrun each rank trains on its shard with
DistributedDataParallel (gloo on CPU, nccl on GPU); rank 0 evaluates and writes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from .data import load
from .data.sequences import leave_one_out, user_sequences
from .models import HSTURetrieval, OneRankModel, Popularity, SASRecRetrieval, make_batch, make_requests
from .models.ranking import TASKS, auc, ndcg_at
from .nn import onerank_loss


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="flexhstu train", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["retrieval", "ranking"], default="retrieval")
    p.add_argument("--model", choices=["hstu", "onerank", "sasrec", "popularity"], default="hstu")
    p.add_argument("--data", default="ml-100k", help="ml-100k, synthetic, or a ratings.dat / ratings.csv / .parquet path")
    p.add_argument("--mask", choices=["causal", "sla"], default="causal")
    p.add_argument("--sla-k1", type=int, default=32)
    p.add_argument("--sla-k2", type=int, default=4)
    p.add_argument("--no-task-tokens", action="store_true", help="ranking ablation: plain target tokens, fixed targets mask")
    p.add_argument("--epochs", type=int, default=None, help="default: 60 for retrieval, 4 for ranking")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--max-len", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--negatives", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/latest")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this many epochs of this invocation (tests)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.epochs is None:
        a.epochs = 60 if a.task == "retrieval" else 4
    if a.task == "ranking" and a.model not in ("onerank",):
        p.error(f"--model: ranking trains 'onerank' (use --no-task-tokens for the ablation), got {a.model!r}")
    if a.task == "retrieval" and a.model == "onerank":
        p.error("--model onerank needs --task ranking")
    return a


def _dist() -> tuple[int, int]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def retrieval_metrics(model, seqs, inputs_end: int, targets: list[int], max_len: int, device, k: int = 10) -> dict:
    """HR@k and NDCG@k; inputs are each sequence without its last ``inputs_end`` events."""
    hits, ndcg = [], []
    if hasattr(model, "eval"):
        model.eval()
    for s in range(0, len(seqs.items), 256):
        items = [x[:len(x) - inputs_end] for x in seqs.items[s:s + 256]]
        times = [x[:len(x) - inputs_end] for x in seqs.times[s:s + 256]]
        batch = make_batch(items, times, max_len, with_targets=False).to(device)
        scores = model.scores(batch).float().cpu()
        for r, (hist, tgt) in enumerate(zip(items, targets[s:s + 256])):
            row = scores[r].clone()
            row[0] = -math.inf
            seen = torch.from_numpy(hist[hist != tgt])
            row[seen] = -math.inf
            rank = int((row > row[tgt]).sum())
            hits.append(rank < k)
            ndcg.append(1.0 / math.log2(rank + 2) if rank < k else 0.0)
    return {f"HR@{k}": float(np.mean(hits)), f"NDCG@{k}": float(np.mean(ndcg))}


def ranking_metrics(model, req, device) -> dict:
    """AUC per task over all candidates; NDCG@10 per task within each candidate list (lists without a positive skipped)."""
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for s in range(0, len(req.cand_items), 128):
            sc, lab, _ = model(req, list(range(s, min(s + 128, len(req.cand_items)))), device)
            scores.append(sc.float().cpu().numpy()), labels.append(lab.cpu().numpy())
    allsc, alllab = np.concatenate(scores), np.concatenate(labels)
    starts = np.cumsum([0] + [len(c) for c in req.cand_items])
    out = {}
    for t, name in enumerate(TASKS):
        out[f"AUC {name}"] = auc(allsc[:, t], alllab[:, t])
        vals = [ndcg_at(allsc[a:b, t], alllab[a:b, t]) for a, b in zip(starts[:-1], starts[1:])]
        vals = [v for v in vals if not math.isnan(v)]
        out[f"NDCG@10 {name}"] = float(np.mean(vals)) if vals else float("nan")
    return out


def build(a, num_items):
    if a.model == "hstu":
        return HSTURetrieval(num_items, a.dim, a.layers, a.heads, a.max_len, a.mask, a.sla_k1, a.sla_k2, a.dropout)
    if a.model == "sasrec":
        return SASRecRetrieval(num_items, a.dim, a.layers, a.heads, a.max_len, a.dropout)
    return OneRankModel(num_items, a.dim, a.layers, a.heads, a.max_len, not a.no_task_tokens, a.dropout)


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in history[0] if k not in ("epoch", "seconds")]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot([h["epoch"] for h in history], [h[key] for h in history], marker="o")
        ax.set_title(key)
        ax.set_xlabel("epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    a = parse(argv)
    rank, world = _dist()
    out = Path(a.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    device = torch.device(a.device if a.device != "cuda" else f"cuda:{rank % max(torch.cuda.device_count(), 1)}")
    torch.manual_seed(a.seed)
    data = load(a.data)
    result: dict = {"args": vars(a)}

    if a.task == "retrieval":
        seqs, valid, test = leave_one_out(data)
        train_items = [x[:-2] for x in seqs.items]
        if a.model == "popularity":
            pop = Popularity(train_items, data.num_items)
            result["valid"] = retrieval_metrics(pop, seqs, 2, valid, a.max_len, "cpu")
            pop = Popularity([x[:-1] for x in seqs.items], data.num_items)
            result["test"] = retrieval_metrics(pop, seqs, 1, test, a.max_len, "cpu")
            return _finish(result, [], out, rank, a)
        units = list(range(len(seqs.items)))
    else:
        seqs = user_sequences(data)
        train_req = make_requests(seqs, "train", max_len=a.max_len, seed=a.seed)
        valid_req = make_requests(seqs, "valid", max_len=a.max_len, seed=a.seed + 1)
        test_req = make_requests(seqs, "test", max_len=a.max_len, seed=a.seed + 2)
        units = list(range(len(train_req.cand_items)))

    model = build(a, data.num_items).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    history, start = [], 0
    best = {"score": -math.inf, "epoch": 0, "model": None}
    ckpt = out / "checkpoint.pt"
    if a.resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
        history, start, best = state["history"], state["epoch"], state["best"]
    epochs_run = 0
    for epoch in range(start, a.epochs):
        if a.stop_after and epochs_run >= a.stop_after:
            break
        torch.manual_seed(a.seed * 1000 + epoch)  # dropout stream of this epoch
        gen = torch.Generator().manual_seed(a.seed * 1000 + epoch)
        order = torch.randperm(len(units), generator=gen).tolist()
        per_rank = len(order) // world
        mine = order[rank * per_rank:(rank + 1) * per_rank]
        batches = [mine[i:i + a.batch_size] for i in range(0, len(mine), a.batch_size)]
        model.train()
        t0, tokens, losses = time.perf_counter(), 0, []
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{a.epochs}", disable=a.quiet or rank != 0, dynamic_ncols=True)
        for idx in bar:
            if a.task == "retrieval":
                batch = make_batch([train_items[i] for i in idx], [seqs.times[i][:-2] for i in idx], a.max_len).to(device)
                loss = ddp(batch, a.negatives, gen)  # forward is the sampled-softmax loss
                tokens += batch.items.numel()
            else:
                scores, labels, coffs = ddp(train_req, idx, device)
                loss = onerank_loss(scores, labels, coffs)
                tokens += sum(len(train_req.hist_items[i]) + 4 * len(train_req.cand_items[i]) for i in idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        epochs_run += 1
        record = {"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": time.perf_counter() - t0}
        if rank == 0:
            if a.task == "retrieval":
                record.update({f"valid {k}": v for k, v in retrieval_metrics(model, seqs, 2, valid, a.max_len, device).items()})
            else:
                record.update({f"valid {k}": v for k, v in ranking_metrics(model, valid_req, device).items()})
            history.append(record)
            score = record["valid NDCG@10"] if a.task == "retrieval" else float(
                np.nanmean([record[f"valid AUC {t}"] for t in TASKS]))
            if score > best["score"]:
                best = {"score": score, "epoch": epoch + 1, "model": copy.deepcopy(model.state_dict())}
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "history": history, "epoch": epoch + 1,
                        "best": best}, ckpt)
            if not a.quiet:
                print(json.dumps(record))
        if world > 1:
            dist.barrier()
    if rank == 0 and (not a.stop_after or len(history) >= a.epochs):
        if best["model"] is not None:
            model.load_state_dict(best["model"])
            result["best_epoch"] = best["epoch"]
        if a.task == "retrieval":
            result["test"] = retrieval_metrics(model, seqs, 1, test, a.max_len, device)
        else:
            result["test"] = ranking_metrics(model, test_req, device)
    if world > 1:
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checksum": checksum}))
        dist.barrier()
        dist.destroy_process_group()
    return _finish(result, history, out, rank, a)


def _finish(result, history, out: Path, rank: int, a) -> dict:
    result["history"] = history
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps(result, indent=1, default=str))
        if history:
            plot(history, out / "metrics.png")
        if not a.quiet:
            print(json.dumps({"test": result.get("test")}))
    return result


if __name__ == "__main__":
    main()
