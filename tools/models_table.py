"""Markdown tables for docs/models.md from runs' metrics.json: ``python tools/models_table.py RUN_DIR ...``."""

import json
import sys
from pathlib import Path


def main(dirs):
    runs = [(Path(d).name, json.loads((Path(d) / "metrics.json").read_text())) for d in dirs]
    retrieval = [(n, r) for n, r in runs if r["args"]["task"] == "retrieval"]
    ranking = [(n, r) for n, r in runs if r["args"]["task"] == "ranking"]
    if retrieval:
        print("| run | model | mask | seed | epochs | test HR@10 | test NDCG@10 | train s |")
        print("|---|---|---|---|---|---|---|---|")
        for n, r in retrieval:
            a, t = r["args"], r["test"]
            secs = sum(h["seconds"] for h in r["history"])
            mask = a["mask"] if a["model"] == "hstu" else "-"
            print(f"| {n} | {a['model']} | {mask} | {a['seed']} | {a['epochs'] if r['history'] else '-'} "
                  f"| {t['HR@10']:.4f} | {t['NDCG@10']:.4f} | {secs:.0f} |")
    if ranking:
        keys = list(ranking[0][1]["test"])
        print("\n| run | task tokens | " + " | ".join(keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for n, r in ranking:
            print(f"| {n} | {'no' if r['args']['no_task_tokens'] else 'yes'} | "
                  + " | ".join(f"{r['test'][k]:.4f}" for k in keys) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
