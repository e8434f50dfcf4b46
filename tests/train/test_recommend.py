"""Recommendations from a trained run: top-K unseen items in the data file's ids, or given candidates ranked."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from tiny_run import TINY_MODEL

from flexhstu import train
from flexhstu.cli.main import main
from flexhstu.data import load, synthetic
from flexhstu.data.sequences import user_sequences
from flexhstu.models import make_batch
from flexhstu.recommend import Recommender

TINY = [*TINY_MODEL, "--quiet", "--epochs", "1"]
COLUMNS = {"user": "who", "item": "what", "time": "when", "rating": "stars"}


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    """A one-epoch HSTU run on a CSV whose ids are strings."""
    root = tmp_path_factory.mktemp("rec")
    d = synthetic(num_users=60, num_items=40, length=20)
    rows = (f"{t},u{u},i{i},{r:g}\n" for u, i, t, r in zip(d.user, d.item, d.timestamp, d.rating))
    (root / "events.csv").write_text("when,who,what,stars\n" + "".join(rows))
    data = str(root / "events.csv")
    train.main(
        TINY
        + ["--data", data, "--columns", ",".join(f"{k}={v}" for k, v in COLUMNS.items()), "--out", str(root / "run")]
    )
    return root, data


def test_retrieval_gives_the_k_best_unseen_items_in_the_files_ids(csv_run):
    root, data = csv_run
    rec = Recommender.from_checkpoint(root / "run" / "checkpoint.pt")
    (answer,) = rec.recommend(["u3"], k=5)
    loaded = load(data, columns=COLUMNS)
    code = list(loaded.user_ids).index("u3")
    seq = user_sequences(loaded)
    s = int(np.flatnonzero(seq.users == code)[0])
    seen = {loaded.item_ids[i - 1] for i in seq.items[s]}
    scores = rec.model.scores(make_batch([seq.items[s]], [seq.times[s]], 20, with_targets=False))[0]
    unseen = [i for i in range(1, loaded.num_items + 1) if loaded.item_ids[i - 1] not in seen]
    want = sorted(unseen, key=lambda i: -float(scores[i]))[:5]  # independent ranking of the model's scores
    assert answer.items == [loaded.item_ids[i - 1] for i in want]
    assert not seen & set(answer.items) and list(answer.scores) == sorted(answer.scores, reverse=True)
    with_seen = rec.recommend(["u3"], k=loaded.num_items, include_seen=True)[0]
    assert seen <= set(with_seen.items)


def test_retrieval_among_candidates_ranks_only_those(csv_run):
    root, _ = csv_run
    rec = Recommender.from_checkpoint(root / "run" / "checkpoint.pt")
    (answer,) = rec.recommend(["u7"], k=10, candidates=["i1", "i2", "i5"], include_seen=True)
    assert sorted(answer.items) == ["i1", "i2", "i5"]
    # Given candidates are all ranked, seen or not (guards against: seen ones vanished, leaving "user 7: ", exit 0).
    seen = [rec.item_ids[i - 1] for i in rec.histories["u7"][0][:3]]
    (answer,) = rec.recommend(["u7"], k=10, candidates=seen)
    assert sorted(answer.items) == sorted(set(seen))
    with pytest.raises(ValueError, match="--users: expected at least one user id, got none"):
        rec.recommend([], k=3)


def test_the_command_prints_one_line_per_user_and_names_a_wrong_user(csv_run, capsys):
    root, _ = csv_run
    ckpt = str(root / "run" / "checkpoint.pt")
    assert main(["recommend", "--checkpoint", ckpt, "--users", "u1,u2", "--k", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["user u1", "user u2"] and all(
        line.count("(") == 3 for line in lines
    )
    assert main(["recommend", "--checkpoint", ckpt, "--users", "nobody"]) == 2
    assert capsys.readouterr().err.strip() == (
        "flexhstu recommend: error: --users: expected users of the run's data (with 3 or more events), got 'nobody'"
    )
    # Audit: an id holding a comma could not be asked for; in double quotes it is one id.
    assert main(["recommend", "--checkpoint", ckpt, "--users", 'u1, "u2,x"']) == 2
    assert capsys.readouterr().err.strip().endswith("got 'u2,x'")


def test_a_repeated_user_is_answered_once_in_the_order_first_given(csv_run, capsys):
    # Guards against: --users u2,u1,u2 printed user u2's line twice.
    root, _ = csv_run
    ckpt = str(root / "run" / "checkpoint.pt")
    assert main(["recommend", "--checkpoint", ckpt, "--users", "u2,u1,u2", "--k", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["user u2", "user u1"]


def test_a_k_beyond_the_users_unseen_items_lists_them_all_and_says_so(csv_run, capsys):
    # Guards against: --k 1000 gave a shorter line than asked, with nothing to say why.
    root, _ = csv_run
    ckpt = str(root / "run" / "checkpoint.pt")
    rec = Recommender.from_checkpoint(ckpt)
    unseen = len(rec.item_ids) - len(set(rec.histories["u1"][0].tolist()))
    assert main(["recommend", "--checkpoint", ckpt, "--users", "u1", "--k", "1000"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("(") == unseen < 1000
    assert captured.err == f"flexhstu recommend: --k 1000: user u1 has only {unseen} unseen items; all are listed\n"
    assert main(["recommend", "--checkpoint", ckpt, "--users", "u1", "--k", "3"]) == 0
    assert capsys.readouterr().err == ""


def test_candidates_without_k_are_all_ranked_without_a_note_about_k(csv_run, capsys):
    # Guards against: --candidates i1,i2,i3 without --k printed "--k 10: user u1 has only 3 candidates", about an
    # option the user never gave.
    root, _ = csv_run
    ckpt = str(root / "run" / "checkpoint.pt")
    assert main(["recommend", "--checkpoint", ckpt, "--users", "u1", "--candidates", "i1,i2,i3"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.count("(") == 3
    assert main(["recommend", "--checkpoint", ckpt, "--users", "u1"]) == 0  # the catalogue: the top 10
    assert capsys.readouterr().out.count("(") == 10


def test_a_ranking_model_scores_the_given_candidates_per_task(tmp_path):
    train.main(TINY + ["--data", "synthetic", "--task", "ranking", "--model", "onerank", "--out", str(tmp_path)])
    rec = Recommender.from_checkpoint(tmp_path / "checkpoint.pt")
    (answer,) = rec.recommend([4], k=2, candidates=[5, 9, 12, 30], include_seen=True)
    assert len(answer.items) == 2 and set(answer.items) <= {5, 9, 12, 30} and answer.scores.shape == (2, 3)
    everything = rec.recommend([4], k=4, candidates=[5, 9, 12, 30])[0]  # all four, seen or not
    assert sorted(everything.items) == [5, 9, 12, 30]
    assert answer.items == everything.items[:2] and answer.scores[0, 0] >= answer.scores[1, 0]
    # Guards against: a repeated candidate was scored and listed twice.
    assert rec.recommend([4], k=4, candidates=[5, 9, 5, 12, 30, 9])[0].items == everything.items
    with pytest.raises(ValueError, match="--candidates: expected the items to score"):
        rec.recommend([4])
    with pytest.raises(ValueError, match="--candidates: expected items of the run's data, got '999'"):
        rec.recommend([4], candidates=[999])


def test_a_model_whose_scores_are_not_finite_is_refused(csv_run, tmp_path, capsys):
    # Guards against: the checkpoint of a diverged run (--lr 1e9) printed NaN scores in the catalogue's order, exit 0.
    import torch

    from flexhstu import checkpoint

    root, _ = csv_run
    state = checkpoint.load(root / "run" / "checkpoint.pt")
    weights = state["best"]["model"] or state["model"]
    state["best"]["model"] = {
        k: torch.full_like(v, math.nan) if v.is_floating_point() else v for k, v in weights.items()
    }
    diverged = tmp_path / "checkpoint.pt"
    checkpoint.save(state, diverged)
    assert main(["recommend", "--checkpoint", str(diverged), "--users", "u1,u2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        "flexhstu recommend: error: --checkpoint: expected a model whose scores are finite, got nan scores for user "
        "u1 (its run diverged: train it again with a lower --lr)"
    ]
    assert main(["recommend", "--checkpoint", str(diverged), "--users", "u1", "--candidates", "i1,i2"]) == 2


def test_other_data_than_the_runs_is_refused(csv_run):
    root, data = csv_run
    lines = Path(data).read_text().splitlines()
    other = root / "other.csv"
    other.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    with pytest.raises(ValueError, match=rf"--data {other}: expected the run's data \(\d+ events, 40 items\), got"):
        Recommender.from_checkpoint(root / "run" / "checkpoint.pt", data=str(other))


def test_a_checkpoint_without_a_runs_entries_or_with_other_weights_is_one_clear_error(csv_run, tmp_path):
    # Guards against: both gave a traceback (KeyError 'config'; load_state_dict's size mismatch report).
    import torch

    from flexhstu import checkpoint

    root, data = csv_run
    empty = tmp_path / "empty.pt"
    checkpoint.save({}, empty)
    with pytest.raises(ValueError, match=rf"{empty}: not a complete flexhstu run checkpoint \(no 'config' entry\)"):
        Recommender.from_checkpoint(empty, data=data)
    state = checkpoint.load(root / "run" / "checkpoint.pt")
    state["best"] = {**state["best"], "model": {k: torch.zeros(3) for k in state["model"]}}
    other = tmp_path / "other.pt"
    checkpoint.save(state, other)
    with pytest.raises(ValueError, match=rf"{other}: the weights do not fit the run's model \(size mismatch"):
        Recommender.from_checkpoint(other, data=data)


def test_a_run_with_sharded_embeddings_recommends_from_its_sharded_best(tmp_path):
    # Guards against: KeyError 'model' (the best weights of such a run are a sharded folder).
    out = tmp_path / "run"
    train.main(TINY + ["--data", "synthetic", "--shard-embeddings", "rowwise", "--out", str(out)])
    rec = Recommender.from_checkpoint(out / "checkpoint.pt")
    [r] = rec.recommend([next(iter(rec.histories))], 5)
    assert len(r.items) == 5


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_a_device_that_is_not_here_is_named_not_the_checkpoint(csv_run):
    # Guards against: the error blamed the checkpoint ("not a complete flexhstu checkpoint (RuntimeError: ...CUDA...)").
    root, data = csv_run
    with pytest.raises(ValueError, match=r"--device: expected cpu \(CUDA is not available here\), got 'cuda'"):
        Recommender.from_checkpoint(root / "run" / "checkpoint.pt", data=data, device="cuda")
