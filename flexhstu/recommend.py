"""``flexhstu recommend``: top-K items per user from a trained run, in the data file's ids.

A retrieval model ranks the whole catalogue for each user after the user's full history; a ranking
model (OneRank) scores the candidates it is given, one score per task. Items the user has already seen
are left out unless ``include_seen``. The checkpoint records the run's arguments and the data file's
ids; the histories are read again from the run's data (or ``data=``, for a file that moved), which must
be the file the model was trained on.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .cli.common import Parser, UserError, checked_device, positive_int, run, user_input
from .data import data_digest, load, synthetic
from .data.sequences import user_sequences
from .models import ModelConfig, build_model, make_batch
from .models.ranking import TASKS
from .run_settings import SYNTHETIC_DEFAULTS, saved_config


@dataclass
class Recommendation:
    """One user's answer: ``items`` in the data file's ids, best first, with their ``scores``
    (retrieval: ``(k,)`` similarity; ranking: ``(k, len(TASKS))``, ordered by the first task)."""

    user: object
    items: list
    scores: np.ndarray


class Recommender:
    """A trained model with the histories and ids of its run's data."""

    def __init__(self, model: torch.nn.Module, config: dict, histories: dict, item_ids: list, device="cpu"):
        self.model, self.config, self.device = model.eval(), config, torch.device(device)
        self.histories = histories  # str(user id) -> (items, times), items as indices 1..num_items
        self.item_ids = item_ids
        self.item_index = {str(x): i + 1 for i, x in enumerate(item_ids)}
        self.ranking = config["task"] == "ranking"

    @classmethod
    def from_checkpoint(cls, path: str | Path, data: str | None = None, device="cpu") -> Recommender:
        """The best-validation weights of the run of ``path`` (a ``checkpoint.pt``); ``data`` replaces the run's
        ``--data`` path (same contents required)."""
        path = Path(path)
        device = checked_device(device)  # a bad device is not a bad checkpoint
        state = checkpoint.load(path, map_location=device)
        checkpoint.require(state, path, "config", "best")
        config = saved_config(state, path)
        if "item_ids" not in state:
            raise ValueError(
                f"{path}: expected a checkpoint that records the data's ids (written by this flexhstu "
                "version); train the run again"
            )
        source = data or config["data"]
        if source == "synthetic":  # the run's sizes, not load's defaults
            sizes = [config.get(k) or default for k, default in SYNTHETIC_DEFAULTS.items()]  # users, items, length
            loaded = synthetic(*sizes)
        else:
            loaded = load(source, columns=config.get("columns"))
        if len(loaded) != config["data_rows"] or loaded.num_items != config["num_items"]:
            why = (
                f"; the file holds {loaded.duplicates} duplicate events, which this flexhstu drops and the run "
                "(an older flexhstu) trained on"
                if len(loaded) + loaded.duplicates == config["data_rows"] and loaded.duplicates
                else ""
            )
            raise ValueError(
                f"--data {source}: expected the run's data ({config['data_rows']} events, "
                f"{config['num_items']} items), got {len(loaded)} events, {loaded.num_items} items{why}"
            )
        if source != "synthetic" and config.get("data_digest") not in (None, data_digest(loaded)):
            raise ValueError(
                f"--data {source}: expected the run's data, got other contents of the same size (its "
                "events or ids differ from those the run trained on)"
            )
        try:
            model = build_model(ModelConfig.from_settings(config), config["num_items"]).to(device)
        except (TypeError, ValueError) as e:  # a setting of the wrong kind (every key is there: saved_config)
            raise ValueError(
                f"{path}: not a complete flexhstu run checkpoint (its configuration does not build "
                f"the run's model: {e})"
            ) from e
        best = state["best"]
        if best.get("dir"):  # a run with sharded embeddings: its best weights are a sharded folder beside the file
            checkpoint.load_sharded(path.parent / best["dir"], model)
        else:
            weights = best.get("model")
            checkpoint.load_weights(model, weights if weights is not None else state.get("model"), path)
        seqs = user_sequences(loaded)
        histories = {str(u): (items, times) for u, items, times in zip(state["user_ids"], seqs.items, seqs.times)}
        return cls(model, config, histories, state["item_ids"], device)

    def _history(self, user) -> tuple[np.ndarray, np.ndarray]:
        if str(user) not in self.histories:
            raise ValueError(f"--users: expected users of the run's data (with 3 or more events), got '{user}'")
        return self.histories[str(user)]

    def _candidates(self, candidates) -> np.ndarray:
        candidates = _distinct(candidates)  # a repeated id: one item, scored once (it was listed twice)
        missing = [c for c in candidates if str(c) not in self.item_index]
        if missing:
            raise ValueError(f"--candidates: expected items of the run's data, got '{missing[0]}'")
        return np.array([self.item_index[str(c)] for c in candidates], dtype=np.int64)

    @torch.no_grad()
    def recommend(
        self, users: list, k: int = 10, *, candidates: list | None = None, include_seen: bool = False
    ) -> list[Recommendation]:
        """Top ``k`` items for each of ``users`` (the data file's ids), among ``candidates`` (ids) if given (a
        ranking model needs them): given candidates are all ranked, seen or not; without them the whole catalogue
        is, less the items a user has seen unless ``include_seen``. A repeated user or candidate counts once."""
        if not users:
            raise ValueError("--users: expected at least one user id, got none")
        if self.ranking and not candidates:
            raise ValueError(
                "--candidates: expected the items to score (a ranking model scores given candidates), got none"
            )
        cand = self._candidates(candidates) if candidates else None
        return [self._one(user, k, cand, include_seen) for user in _distinct(users)]  # a repeated user: one answer

    def _one(self, user, k: int, cand: np.ndarray | None, include_seen: bool) -> Recommendation:
        items, times = self._history(user)
        max_len = self.config["max_len"]
        if self.ranking:
            pool = cand  # the items asked about, seen or not: dropping seen ones would leave an asked item unanswered
            hist, ht = items[-max_len:], times[-max_len:]
            args = [torch.from_numpy(x).to(self.device) for x in (hist, ht)]
            offs = [torch.tensor([0, n], device=self.device) for n in (len(hist), len(pool))]
            scores = self.model(args[0], args[1], offs[0], torch.from_numpy(pool).to(self.device), offs[1]).cpu()
            _check_finite(scores, user)
            order = torch.argsort(scores[:, 0], descending=True, stable=True)[:k]
            return Recommendation(user, [self.item_ids[i - 1] for i in pool[order.numpy()]], scores[order].numpy())
        row = self.model.scores(make_batch([items], [times], max_len, with_targets=False).to(self.device))[0].cpu()
        allowed = torch.zeros_like(row, dtype=torch.bool)
        allowed[torch.from_numpy(cand) if cand is not None else slice(1, None)] = True  # item 0 is padding
        if cand is None and not include_seen:
            allowed[torch.from_numpy(items)] = False
        _check_finite(row[allowed], user)
        row = torch.where(allowed, row.float(), -torch.inf)
        top = torch.topk(row, min(k, int(allowed.sum()))).indices
        return Recommendation(user, [self.item_ids[i - 1] for i in top.tolist()], row[top].numpy())


def _check_finite(scores: torch.Tensor, user) -> None:
    """A model whose scores are NaN or infinite (a diverged run) has no order to give: its top K would be the
    catalogue's own order, printed with NaN scores as if it were an answer."""
    bad = scores[~torch.isfinite(scores)]
    if len(bad):
        raise ValueError(
            f"--checkpoint: expected a model whose scores are finite, got {float(bad[0])} scores for "
            f"user {user} (its run diverged: train it again with a lower --lr)"
        )


def _distinct(ids: list) -> list:
    """``ids`` without repeats (compared as text, as the lookups are), in the order first given."""
    first: dict = {}
    for x in ids:
        first.setdefault(str(x), x)
    return list(first.values())


DEFAULT_K = 10  # items per user without --k and --candidates


def build_parser() -> Parser:
    p = Parser(prog="flexhstu recommend", description="Top-K items per user from a trained run, in the data's ids.")
    p.add_argument("--checkpoint", default="runs/latest/checkpoint.pt", help="the run's checkpoint.pt")
    p.add_argument(
        "--users",
        required=True,
        help="comma-separated user ids of the run's data, e.g. 1,2,3 (an id with a comma in double "
        "quotes: '\"a,b\",c')",
    )
    p.add_argument(
        "--k",
        type=positive_int,
        default=None,
        help=f"items per user (not given: {DEFAULT_K}, or every candidate with --candidates)",
    )
    p.add_argument(
        "--candidates",
        default=None,
        help="comma-separated item ids to rank (required for a ranking model; else the whole catalogue)",
    )
    p.add_argument(
        "--include-seen",
        action="store_true",
        help="without --candidates: keep items the user has already seen (given candidates are all ranked)",
    )
    p.add_argument("--data", default=None, help="the run's data file, if it moved since training")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    return p


def _ids(text: str | None, arg: str) -> list[str] | None:
    """Comma-separated ids, read as one CSV line: an id holding a comma is written in double quotes."""
    if not text:
        return None
    try:
        ids = next(csv.reader([text], skipinitialspace=True, strict=True))
    except csv.Error:
        raise ValueError(
            f"{arg}: expected comma-separated ids (one holding a comma in double quotes), got {text!r} "
            "(a quote is not closed)"
        ) from None
    return [x.strip() for x in ids if x.strip()]


def cli(argv=None) -> int:
    """The command: one line per user, ``user U: item (score), ...``; exit status 2 for an input error."""
    a = build_parser().parse_args(argv)

    def command() -> int:
        with user_input():
            users, candidates = _ids(a.users, "--users"), _ids(a.candidates, "--candidates")
        if a.candidates is not None and not candidates:  # '' would otherwise rank the whole catalogue
            raise UserError(f"--candidates: expected comma-separated item ids, got '{a.candidates}'")
        with user_input():
            rec = Recommender.from_checkpoint(a.checkpoint, data=a.data, device=a.device)
            k = a.k or (len(candidates) if candidates else DEFAULT_K)
            answers = rec.recommend(users, k, candidates=candidates, include_seen=a.include_seen)
        if rec.ranking:
            print("scores: " + ", ".join(TASKS))
        for r in answers:
            scores = [f"{s:.4f}" if np.ndim(s) == 0 else "/".join(f"{x:.3f}" for x in s) for s in r.scores]
            print(f"user {r.user}: " + ", ".join(f"{i} ({s})" for i, s in zip(r.items, scores)))
            if a.k is not None and len(r.items) < a.k:  # fewer than --k exist: all are listed, and the user is told
                pool = "candidates" if candidates else "items" if a.include_seen else "unseen items"
                print(
                    f"flexhstu recommend: --k {a.k}: user {r.user} has only {len(r.items)} {pool}; all are listed",
                    file=sys.stderr,
                )
        return 0

    return run("flexhstu recommend", command, a.debug)


if __name__ == "__main__":
    sys.exit(cli())
