"""tools/models_table.py: mean +- std over the seeds of each configuration, from runs' metrics.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("models_table", Path(__file__).parents[2] / "tools" / "models_table.py")
models_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models_table)

ARGS = {
    "task": "retrieval",
    "model": "hstu",
    "mask": "causal",
    "sla_k1": 32,
    "sla_k2": 4,
    "no_task_tokens": False,
    "data": "/data/ml-100k.inter",
    "epochs": 60,
}


def _run(folder: Path, args: dict, test: dict | None) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"args": args, "test": test, "history": []}))


def test_seeds_of_one_configuration_give_mean_and_sample_std(tmp_path, capsys):
    _run(tmp_path / "hstu" / "seed0", {**ARGS, "seed": 0}, {"HR@10": 0.10, "NDCG@10": 0.05})
    _run(tmp_path / "hstu" / "seed1", {**ARGS, "seed": 1}, {"HR@10": 0.20, "NDCG@10": 0.07})
    _run(tmp_path / "hstu" / "seed2", {**ARGS, "seed": 2}, None)  # unfinished: no test metrics
    ranking = {**ARGS, "task": "ranking", "model": "onerank", "no_task_tokens": True, "epochs": 4, "seed": 0}
    _run(tmp_path / "onerank" / "seed0", ranking, {"AUC watched": 0.7, "AUC rated>=4": 0.6, "AUC rated5": 0.5})
    assert models_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    # HR@10: mean 0.15, sample std sqrt(((0.05)^2 * 2) / 1) = 0.0707; NDCG@10: mean 0.06, std 0.0141
    assert "| HSTU, causal | ml-100k.inter | 60 | 2 | 0.1500 +- 0.0707 | 0.0600 +- 0.0141 |" in out
    assert (
        "| OneRank, no task tokens (targets mask) | ml-100k.inter | 4 | 1 | 0.7000 +- - | 0.6000 +- - | 0.5000 +- - |"
    ) in out


def test_no_complete_run_is_an_error(tmp_path, capsys):
    assert models_table.main([str(tmp_path)]) == 2
    assert "no complete run" in capsys.readouterr().err


def test_a_metric_written_as_null_is_left_out_of_its_mean(tmp_path, capsys):
    # Review: metrics.json writes null for a NaN AUC (one class absent), and math.isnan(None) raised here.
    ranking = {**ARGS, "task": "ranking", "model": "onerank", "no_task_tokens": True, "epochs": 4}
    for seed, rated5 in ((0, 0.5), (1, None)):
        _run(
            tmp_path / f"seed{seed}",
            {**ranking, "seed": seed},
            {"AUC watched": 0.7, "AUC rated>=4": 0.6, "AUC rated5": rated5},
        )
    assert models_table.main([str(tmp_path)]) == 0
    assert "| 2 | 0.7000 +- 0.0000 | 0.6000 +- 0.0000 | 0.5000 +- - |" in capsys.readouterr().out
