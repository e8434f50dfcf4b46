"""MovieLens interactions (user, item, rating, timestamp), cached as Parquet.

Sources: ``ml-100k`` is read from the ``recbole`` wheel's bundled copy
(``recbole/dataset_example/ml-100k/ml-100k.inter``; located without importing
recbole), ``ratings.dat`` (ML-1M, ``::``-separated) and ``ratings.csv`` (ML-20M,
with a header) from a path, and ``synthetic`` from a seeded generator.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

COLUMNS = ("user", "item", "rating", "timestamp")


@dataclass
class Interactions:
    """Columns as int64 numpy arrays; items re-indexed to 1..num_items (0 is padding)."""

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    num_items: int
    name: str

    def __len__(self) -> int:
        return len(self.user)


def recbole_ml100k_path() -> Path:
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "ml-100k: the recbole wheel is not installed; `pip install --no-deps recbole==1.2.1` ships the "
            "file (its code is not imported), or pass --data PATH to a ratings.dat / ratings.csv"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset_example" / "ml-100k" / "ml-100k.inter"
    if not path.is_file():
        raise FileNotFoundError(f"ml-100k: expected {path} inside the recbole wheel; it is missing")
    return path


def _read_raw(path: Path) -> dict[str, np.ndarray]:
    text = path.read_text(encoding="latin-1").splitlines()
    if not text:
        raise ValueError(f"{path}: expected interactions, got an empty file")
    if path.suffix == ".inter":  # recbole atomic file: header 'user_id:token\titem_id:token\trating:float\ttimestamp:float'
        header = [h.split(":")[0] for h in text[0].split("\t")]
        rows = [line.split("\t") for line in text[1:] if line.strip()]
        names = {"user_id": "user", "item_id": "item", "rating": "rating", "timestamp": "timestamp"}
        header = [names.get(h, h) for h in header]
    elif path.suffix == ".dat":
        header = list(COLUMNS)
        rows = [line.split("::") for line in text if line.strip()]
    elif path.suffix == ".csv":
        header = [h.strip().lower().replace("userid", "user").replace("movieid", "item") for h in text[0].split(",")]
        rows = [line.split(",") for line in text[1:] if line.strip()]
    else:
        raise ValueError(f"{path}: expected a .inter, .dat (ML-1M) or .csv (ML-20M) ratings file, got '{path.suffix}'")
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path}: expected columns {list(COLUMNS)}, missing {missing} (found {header})")
    if not rows:
        raise ValueError(f"{path}: expected interactions after the header, got none")
    cols = {}
    for c in COLUMNS:
        j = header.index(c)
        try:
            cols[c] = np.array([float(r[j]) for r in rows], dtype=np.float64)
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path}: column '{c}' expected numbers on every row: {e}") from e
    if not np.all(np.isfinite(cols["rating"])):
        raise ValueError(f"{path}: column 'rating' expected finite numbers")
    return {c: cols[c].astype(np.int64) if c != "rating" else cols[c] for c in COLUMNS}


def _cache_path(source: Path, cache_dir: Path) -> Path:
    st = source.stat()
    key = hashlib.sha1(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"{source.stem}-{key}.parquet"


def _check_table(table: pa.Table, where: str) -> None:
    for c in COLUMNS:
        if c not in table.column_names:
            raise ValueError(f"{where}: expected column '{c}', missing (found {table.column_names})")
    if table.num_rows == 0:
        raise ValueError(f"{where}: expected interactions, got an empty table")
    for c in ("user", "item", "timestamp"):
        if not pa.types.is_integer(table.schema.field(c).type):
            raise ValueError(f"{where}: column '{c}' expected integers, got {table.schema.field(c).type}")


def _to_interactions(table: pa.Table, name: str) -> Interactions:
    _check_table(table, name)
    cols = {c: table.column(c).to_numpy() for c in COLUMNS}
    _, item = np.unique(cols["item"], return_inverse=True)
    return Interactions(cols["user"].astype(np.int64), item.astype(np.int64) + 1, cols["rating"].astype(np.float64),
                        cols["timestamp"].astype(np.int64), int(item.max()) + 1, name)


def load(data: str, cache_dir: str | os.PathLike | None = None) -> Interactions:
    """``ml-100k``, ``synthetic``, a ratings file, or a Parquet file with the four columns."""
    if data == "synthetic":
        return synthetic()
    source = recbole_ml100k_path() if data == "ml-100k" else Path(data)
    if not source.is_file():
        raise FileNotFoundError(f"--data: expected ml-100k, synthetic or a ratings file, got '{data}' (no such file)")
    if source.suffix == ".parquet":
        return _to_interactions(pq.read_table(source), str(source))
    cache = Path(cache_dir or os.environ.get("FLEXHSTU_CACHE", Path.home() / ".cache" / "flexhstu"))
    cache.mkdir(parents=True, exist_ok=True)
    target = _cache_path(source, cache)
    if not target.exists():
        cols = _read_raw(source)
        tmp = target.with_suffix(".tmp")
        pq.write_table(pa.table(cols), tmp)
        tmp.replace(target)
    return _to_interactions(pq.read_table(target), data)


def synthetic(num_users: int = 300, num_items: int = 200, length: int = 40, seed: int = 0) -> Interactions:
    """Users walk a hidden item cycle: the next item is usually ``item + 1`` (planted structure);
    ratings are high on the cycle and low off it."""
    rng = np.random.default_rng(seed)
    users, items, ratings, times = [], [], [], []
    for u in range(num_users):
        cur = int(rng.integers(num_items))
        t = int(rng.integers(1_000_000))
        for _ in range(int(rng.integers(length // 2, length + 1))):
            on_cycle = rng.random() < 0.85
            cur = (cur + 1) % num_items if on_cycle else int(rng.integers(num_items))
            t += int(rng.integers(60, 86_400))
            users.append(u)
            items.append(cur + 1)
            ratings.append(5.0 if on_cycle else float(rng.integers(1, 4)))
            times.append(t)
    return Interactions(np.array(users), np.array(items), np.array(ratings), np.array(times), num_items, "synthetic")
