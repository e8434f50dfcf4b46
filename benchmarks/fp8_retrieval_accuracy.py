"""How e4m3 attention changes a trained HSTU retrieval model's test metrics on MovieLens-100K (issue: FP8 serving).

For each seed: train the retrieval model (``flexhstu train``, its defaults: ``--task retrieval --model hstu``; a
finished run in ``--runs`` is reused), load its best weights (cast to ``--dtype``) and evaluate the test split with
the trainer's own evaluation (``flexhstu.train.evaluation.evaluate``: full-corpus ranking, HR@10 and NDCG@10) twice,
with the attention in the model's dtype and in e4m3. Reports per seed, and as mean and standard deviation over the
seeds, both metrics and their paired difference (e4m3 minus the model's dtype), and from the test scores of both
(the same ranking, checked against the evaluation's HR@10): how many of each user's top-10 items e4m3 keeps, the
score error, the share of users whose target's rank moves and the hits e4m3 gains and loses. The float32
evaluation must reproduce the run's own test metrics (its ``metrics.json``); the script stops if it does not.

The e4m3 attention is the attention of the dequantized values (``flexhstu.ops.fp8``): here every ``hstu_mha`` call
of the STU layers (``flexhstu.nn.stu``) gets ``dequantize_fp8(*quantize_fp8(x))`` for each of q, k and v (cast
back to the model's dtype), all else as it was; the calls are counted. This is what the delta reference computes;
the GPU kernel also rounds ``P`` to bfloat16 for ``P V`` (as the bfloat16 kernel does), which this leaves out.

    python benchmarks/fp8_retrieval_accuracy.py --seeds 0 1 2 3 4 --runs /tmp/fp8-retrieval-runs [--dtype bfloat16]

On a small CPU, ``OMP_NUM_THREADS=1`` trains several times faster than torch's default threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
from fp8_accuracy import trained  # this folder's ranking study: trains a seed or reuses its finished run

import flexhstu.nn.stu as stu
from flexhstu.models import make_batch
from flexhstu.ops.fp8 import dequantize_fp8, quantize_fp8
from flexhstu.train.evaluation import evaluate

METRICS = ("NDCG@10", "HR@10")
TOP = 10


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` through e4m3 and back (per row and head scales), in ``x``'s dtype."""
    return dequantize_fp8(*quantize_fp8(x)).to(x.dtype)


@contextlib.contextmanager
def e4m3_attention(calls: list[int]):
    """Within: the STU layers' attention is that of the e4m3-rounded q, k, v; ``calls[0]`` counts the calls."""
    plain = stu.hstu_mha

    def hooked(max_seq_len, alpha, q, k, v, *args, **kwargs):
        calls[0] += 1
        return plain(max_seq_len, alpha, round_trip(q), round_trip(k), round_trip(v), *args, **kwargs)

    stu.hstu_mha = hooked
    try:
        yield
    finally:
        stu.hstu_mha = plain


def test_scores(model, a, d) -> tuple[torch.Tensor, torch.Tensor]:
    """``(users, num_items + 1)`` float32 scores of the test ranking (each history without its last event), and
    the same with what the ranking leaves out (item 0, the history but the target) at ``-inf``."""
    out = []
    for s in range(0, len(d.seqs.items), 256):
        chunk = range(s, min(s + 256, len(d.seqs.items)))
        items = [d.seqs.items[u][:-1] for u in chunk]
        batch = make_batch(items, [d.seqs.times[u][:-1] for u in chunk], a.max_len, with_targets=False)
        out.append(model.scores(batch).float())
    raw = torch.cat(out)
    ranked = raw.clone()
    ranked[:, 0] = float("-inf")
    for u in range(len(d.seqs.items)):
        hist = torch.from_numpy(d.seqs.items[u][:-1]).long()
        ranked[u, hist[hist != int(d.test[u])]] = float("-inf")
    return raw, ranked


def agreement(base: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """How many of each user's top-TOP items (mean) ``other`` keeps, and the score error (items 1.., every user)."""
    a, b = (torch.topk(x[1], TOP, dim=1).indices.tolist() for x in (base, other))
    err = (other[0][:, 1:] - base[0][:, 1:]).abs()
    return {
        f"kept_top{TOP}": statistics.mean(len(set(x) & set(y)) for x, y in zip(a, b)),
        "score_err_mean": float(err.mean()),
        "score_err_max": float(err.max()),
        "score_spread": float(base[0][:, 1:].std()),
    }


def mean_std(vals: list[float]) -> str:
    return f"{statistics.mean(vals):.5f} +- {statistics.stdev(vals) if len(vals) > 1 else 0:.5f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--runs", default="runs/fp8-retrieval-accuracy", help="a folder per seed (reused when finished)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    p.add_argument("--epochs", type=int, default=0, help="training epochs (0: the trainer's default)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        argv = ["--task", "retrieval", "--model", "hstu", "--seed", str(seed), "--device", "cpu"]
        argv += ["--epochs", str(args.epochs)] if args.epochs else []
        out = Path(args.runs) / f"seed{seed}"
        a, d, model = trained(argv, out)
        run = json.loads((out / "metrics.json").read_text())
        model = model.to(getattr(torch, args.dtype))
        calls = [0]
        with torch.no_grad():
            base = evaluate(a, model, d, "test", torch.device("cpu"))
            base_scores = test_scores(model, a, d)
            with e4m3_attention(calls):
                fp8 = evaluate(a, model, d, "test", torch.device("cpu"))
                fp8_scores = test_scores(model, a, d)
        if args.dtype == "float32":  # the run's own test metrics, reproduced
            for m in METRICS:
                if abs(base[m] - run["test"][m]) > 1e-9:
                    raise SystemExit(f"seed {seed}: {m} {base[m]} here, {run['test'][m]} in the run's metrics.json")
        tgt = torch.tensor([int(t) for t in d.test])
        ranks = []
        for scores, metrics in ((base_scores, base), (fp8_scores, fp8)):  # this ranking is the evaluation's
            ranks.append((scores[1] > scores[1][torch.arange(len(tgt)), tgt, None]).sum(1))
            if abs(float((ranks[-1] < TOP).double().mean()) - metrics["HR@10"]) > 1e-9:
                raise SystemExit(f"seed {seed}: the top-{TOP} scores rank the targets unlike the evaluation")
        if not calls[0]:
            raise SystemExit("the e4m3 hook was never called: the model's attention is not stu.hstu_mha")
        row = {"seed": seed, "best_epoch": run.get("best_epoch"), "hooked_calls": calls[0]}
        for m in METRICS:
            row[m], row[f"{m} e4m3"], row[f"{m} diff"] = base[m], fp8[m], fp8[m] - base[m]
        row |= agreement(base_scores, fp8_scores)
        row["target_rank_changed"] = float((ranks[0] != ranks[1]).double().mean())  # share of users
        row["hits_gained"] = int(((ranks[1] < TOP) & (ranks[0] >= TOP)).sum())
        row["hits_lost"] = int(((ranks[1] >= TOP) & (ranks[0] < TOP)).sum())
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{len(rows)} seeds, model in {args.dtype} (mean +- std):")
    for m in METRICS:
        for key, label in ((m, args.dtype), (f"{m} e4m3", "e4m3"), (f"{m} diff", f"e4m3 - {args.dtype}")):
            print(f"  {m:8} {label:20} {mean_std([r[key] for r in rows])}")
    for key in (f"kept_top{TOP}", "score_err_mean", "score_err_max", "score_spread", "target_rank_changed"):
        print(f"  {key:29} {mean_std([r[key] for r in rows])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
