"""Markdown tables for docs/models.md: mean +- std over seeds of each configuration's test metrics.

    python tools/models_table.py ROOT_OR_RUN_DIR ...

Every ``metrics.json`` under the given folders is one run; runs that differ only in ``--seed`` form one
configuration (model, mask and its parameters, task tokens, data, epochs). Retrieval rows give HR@10 and
NDCG@10, ranking rows the AUC of each task; std is the sample standard deviation (ddof 1; "-" for one run).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

TASKS = ("watched", "rated>=4", "rated5")


def configuration(args: dict) -> tuple[str, str]:
    """(task, a label naming what the runs of one configuration share)."""
    if args["model"] == "hstu":
        label = "HSTU, " + (f"SLA k1={args['sla_k1']} k2={args['sla_k2']}" if args["mask"] == "sla" else "causal")
        if args.get("no_rel_bias"):
            label += ", no rel. bias"
    elif args["model"] == "onerank":
        label = "OneRank, " + ("no task tokens (targets mask)" if args["no_task_tokens"] else "task tokens")
    else:
        label = {"sasrec": "SASRec-style", "popularity": "popularity"}[args["model"]]
    data = Path(args["data"]).name
    return args["task"], f"{label} | {data} | {args['epochs'] if args['model'] != 'popularity' else '-'}"


def mean_std(values: list[float]) -> str:
    mean = float(np.mean(values))
    std = f"{float(np.std(values, ddof=1)):.4f}" if len(values) > 1 else "-"
    return f"{mean:.4f} +- {std}"


def collect(folders: list[str]) -> dict[tuple[str, str], list[dict]]:
    """Test metrics of every complete run (one with a 'test' entry) under ``folders``, by configuration."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("metrics.json")):
            run = json.loads(path.read_text())
            if run.get("test"):
                groups.setdefault(configuration(run["args"]), []).append(run["test"])
    return groups


def tables(groups: dict[tuple[str, str], list[dict]]) -> str:
    lines = []
    retrieval = {label: runs for (task, label), runs in groups.items() if task == "retrieval"}
    ranking = {label: runs for (task, label), runs in groups.items() if task == "ranking"}
    if retrieval:
        lines += ["| model | data | epochs | seeds | test HR@10 | test NDCG@10 |", "|---|---|---|---|---|---|"]
        for label, runs in retrieval.items():
            lines.append(
                f"| {label} | {len(runs)} | {mean_std([r['HR@10'] for r in runs])} | "
                f"{mean_std([r['NDCG@10'] for r in runs])} |"
            )
    if ranking:
        header = "| model | data | epochs | seeds | " + " | ".join(f"test AUC {t}" for t in TASKS) + " |"
        lines += ["" if lines else None, header, "|---|---|---|---|" + "---|" * len(TASKS)]
        for label, runs in ranking.items():
            cells = [mean_std([r[f"AUC {t}"] for r in runs if _number(r[f"AUC {t}"])] or [math.nan]) for t in TASKS]
            lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(x for x in lines if x is not None)


def _number(x) -> bool:
    """A metric that is a number: metrics.json writes null for one that is not (an AUC without both classes)."""
    return x is not None and not math.isnan(x)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    groups = collect(argv)
    if not groups:
        print(
            f"models_table: error: no complete run (metrics.json with test metrics) under {' '.join(argv)}",
            file=sys.stderr,
        )
        return 2
    print(tables(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
