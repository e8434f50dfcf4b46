"""How e4m3 attention changes a trained OneRank model's test metrics on MovieLens-100K (issue: FP8 serving).

For each seed: train the ranking model (``flexhstu train --task ranking --model onerank``; a finished run in
``--runs`` is reused), load its best weights (cast to ``--dtype``), cache every test history and score the
candidates through ``OneRankModel.score_cached`` twice, with the attention in the model's dtype and in e4m3
(``fp8=True``). Reports
per task the test AUC of both (mean and standard deviation over the seeds), how many of each request's top-3
candidates e4m3 keeps (the lists hold 10), the share of candidate pairs it orders alike, and the score error.

On the CPU the delta calls run the PyTorch reference: the attention of the dequantized e4m3 values, which the kernel
computes too (``flexhstu.ops.fp8``; the kernel also rounds P to bfloat16, as the bfloat16 kernel does); on a GPU
they run the Triton kernel.

    python benchmarks/fp8_accuracy.py --seeds 0 1 2 3 4 --runs /tmp/fp8-runs [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from flexhstu import checkpoint
from flexhstu.metrics import auc
from flexhstu.models import build_model
from flexhstu.models.ranking import TASKS
from flexhstu.serving import HistoryCache
from flexhstu.train.loop import build_item_table
from flexhstu.train.loop import main as train_main
from flexhstu.train.options import model_config, parse
from flexhstu.train.splits import prepare_data

TOP = 3  # MovieLens-100K's test lists hold 10 candidates each: their top 10 is the whole list


def trained(argv: list[str], out: Path):
    """The run's arguments, data splits and model with its best weights (trained first unless ``out`` holds a
    finished run)."""
    if not (out / "metrics.json").exists():
        train_main([*argv, "--out", str(out), "--quiet"])
    a = parse([*argv, "--out", str(out)])
    d = prepare_data(a)
    model = build_model(model_config(a), d.num_items, items=build_item_table(a, d.num_items, 1, torch.device("cpu")))
    state = checkpoint.load(out / "checkpoint.pt", map_location="cpu")
    model.load_state_dict(state["best"]["model"] if state["best"].get("model") is not None else state["model"])
    return a, d, model.eval()


def scores(model, req, fp8: bool, chunk: int = 64) -> np.ndarray:
    """``(C, tasks)`` scores of every test candidate, ``chunk`` requests at a time through a history cache."""
    out = []
    g = model.group_size
    longest = max(len(h) + g * len(c) for h, c in zip(req.hist_items, req.cand_items))
    for s in range(0, len(req.cand_items), chunk):
        idx = range(s, min(s + chunk, len(req.cand_items)))
        users = list(idx)
        hist = torch.from_numpy(np.concatenate([req.hist_items[i] for i in idx])).long()
        times = torch.from_numpy(np.concatenate([req.hist_times[i] for i in idx])).long()
        hoffs = torch.tensor([0] + [len(req.hist_items[i]) for i in idx]).cumsum(0)
        cands = torch.from_numpy(np.concatenate([req.cand_items[i] for i in idx])).long()
        coffs = torch.tensor([0] + [len(req.cand_items[i]) for i in idx]).cumsum(0)
        cache = HistoryCache(len(model.stack.layers), longest)
        model.cache_histories(cache, users, hist, times, hoffs)
        out.append(model.score_cached(cache, users, cands, coffs, fp8=fp8).float().numpy())
    return np.concatenate(out)


def agreement(base: np.ndarray, other: np.ndarray, starts: np.ndarray) -> tuple[float, float]:
    """Over requests of more than TOP candidates and over tasks: how many of ``base``'s top-TOP ``other`` keeps
    (mean), and the share of candidate pairs of a request that ``other`` orders as ``base`` does."""
    kept, same, pairs = [], 0, 0
    for lo, hi in itertools.pairwise(starts):
        if hi - lo <= TOP:
            continue
        for t in range(base.shape[1]):
            a = set(np.argsort(-base[lo:hi, t], kind="stable")[:TOP])
            b = set(np.argsort(-other[lo:hi, t], kind="stable")[:TOP])
            kept.append(len(a & b))
            da = np.sign(base[lo:hi, t, None] - base[None, lo:hi, t])
            db = np.sign(other[lo:hi, t, None] - other[None, lo:hi, t])
            off = ~np.eye(hi - lo, dtype=bool)
            same, pairs = same + int((da == db)[off].sum()), pairs + int(off.sum())
    return float(np.mean(kept)), same / pairs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--runs", default="runs/fp8-accuracy", help="a folder per seed (reused when finished)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        argv = ["--task", "ranking", "--model", "onerank", "--seed", str(seed), "--device", "cpu"]
        _, d, model = trained(argv, Path(args.runs) / f"seed{seed}")
        model = model.to(getattr(torch, args.dtype))
        req = d.test
        labels = np.concatenate(req.labels)
        starts = np.cumsum([0] + [len(c) for c in req.cand_items])
        with torch.no_grad():
            base, fp8 = scores(model, req, False), scores(model, req, True)
        kept, same = agreement(base, fp8, starts)
        row = {"seed": seed, f"kept_top{TOP}": kept, "pairs_same_order": same}
        err = np.abs(fp8 - base)
        row["score_err_max"], row["score_err_mean"] = float(err.max()), float(err.mean())
        row["score_spread"] = float(base.std())
        for t, task in enumerate(TASKS):
            row[f"auc {task}"], row[f"auc_fp8 {task}"] = auc(base[:, t], labels[:, t]), auc(fp8[:, t], labels[:, t])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{len(rows)} seeds (mean +- std):")
    for key in rows[0]:
        if key == "seed":
            continue
        vals = [r[key] for r in rows]
        print(f"  {key:22} {statistics.mean(vals):.5f} +- {statistics.stdev(vals) if len(vals) > 1 else 0:.5f}")
    for task in TASKS:
        diff = [r[f"auc_fp8 {task}"] - r[f"auc {task}"] for r in rows]
        rel = [dv / r[f"auc {task}"] for dv, r in zip(diff, rows)]
        print(f"  AUC {task} e4m3 - model dtype: {statistics.mean(diff):+.5f} (relative {statistics.mean(rel):+.4%})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
