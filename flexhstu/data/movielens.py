"""MovieLens interactions (user, item, rating, timestamp), cached as Parquet.

Sources: ``ml-100k`` is read from the ``recbole`` wheel's bundled copy
(``recbole/dataset_example/ml-100k/ml-100k.inter``; located without importing
recbole), ``ratings.dat`` (ML-1M, ``::``-separated) and ``ratings.csv`` (ML-20M,
with a header) from a path, and ``synthetic`` from a seeded generator. Any other
CSV or Parquet file of interactions is read with a column mapping (``columns=``,
the command line's ``--columns user=uid,item=iid,time=ts,rating=r``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

COLUMNS = ("user", "item", "rating", "timestamp")
MAPPED = ("user", "item", "time", "rating")  # the keys of a column mapping; rating is optional


@dataclass
class Interactions:
    """Columns as int64 (rating float64) numpy arrays; items re-indexed to 1..num_items (0 is padding).

    ``item_ids[i - 1]`` is the file's id of item ``i``. ``user`` holds the file's user ids when they are
    integers; otherwise codes ``0..U-1`` with ``user_ids[u]`` the file's id of code ``u``."""

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    num_items: int
    name: str
    item_ids: np.ndarray | None = None
    user_ids: np.ndarray | None = None
    duplicates: int = 0  # exact duplicate events dropped when read

    def __len__(self) -> int:
        return len(self.user)


def recbole_ml100k_path() -> Path:
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "ml-100k: the recbole wheel is not installed; `pip install --no-deps recbole==1.2.1` ships the "
            "file (its code is not imported), or pass --data PATH to a ratings.dat / ratings.csv"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k" / "ml-100k.inter"
    if not path.is_file():
        raise FileNotFoundError(f"ml-100k: expected {path} inside the recbole wheel; it is missing")
    return path


INT64_RANGE = (-(2**63), 2**63 - 1)


def _parse_int(text: str) -> int:
    value = int(text)  # int() refuses '1.5', 'nan' and '1e3': ids and timestamps are exact
    if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise ValueError("outside the int64 range")
    return value


def _parse_rating(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


def _read_raw(path: Path) -> dict[str, np.ndarray]:
    """Columns of a ratings file: user, item, timestamp as exact integers, rating as finite floats."""
    lines = path.read_text(encoding="latin-1").splitlines()
    if not lines:
        raise ValueError(f"{path}: expected interactions, got an empty file")
    numbered = list(enumerate(lines, start=1))  # file line numbers for error messages
    if path.suffix == ".inter":  # recbole atomic file: header 'user_id:token<TAB>item_id:token<TAB>rating:float...'
        header = [h.split(":")[0] for h in lines[0].split("\t")]
        rows = [(n, line.split("\t")) for n, line in numbered[1:] if line.strip()]
        names = {"user_id": "user", "item_id": "item", "rating": "rating", "timestamp": "timestamp"}
        header = [names.get(h, h) for h in header]
    elif path.suffix == ".dat":
        header = list(COLUMNS)
        rows = [(n, line.split("::")) for n, line in numbered if line.strip()]
    elif path.suffix == ".csv":
        header = [h.strip().lower().replace("userid", "user").replace("movieid", "item") for h in lines[0].split(",")]
        rows = [(n, line.split(",")) for n, line in numbered[1:] if line.strip()]
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
        parse, kind, dtype = (
            (_parse_rating, "a finite number", np.float64) if c == "rating" else (_parse_int, "an integer", np.int64)
        )
        values = []
        for n, r in rows:
            text = r[j].strip() if j < len(r) else ""
            try:
                values.append(parse(text))
            except ValueError as e:
                why = f" ({e})" if str(e) == "outside the int64 range" else ""
                raise ValueError(f"{path}, line {n}, column '{c}': expected {kind}, got '{text}'{why}") from None
        cols[c] = np.array(values, dtype=dtype)
    return cols


def _cache_path(source: Path, cache_dir: Path) -> Path:
    st = source.stat()
    key = hashlib.sha1(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"{source.stem}-{key}.parquet"


def _check_table(table: pa.Table, where: str, names: dict[str, str] | None = None) -> None:
    """The four columns, typed; ``names`` maps them to the file's column names for error messages."""
    names = names or {c: c for c in COLUMNS}
    for c in COLUMNS:
        if c not in table.column_names:
            raise ValueError(f"{where}: expected column '{c}', missing (found {table.column_names})")
    if table.num_rows == 0:
        raise ValueError(f"{where}: expected interactions, got an empty table")
    for c in COLUMNS:
        kind = table.schema.field(c).type
        ok = {
            "user": pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind),
            "item": pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind),
            "timestamp": pa.types.is_integer(kind),
            "rating": pa.types.is_integer(kind) or pa.types.is_floating(kind),
        }[c]
        expected = {
            "user": "integer or string ids",
            "item": "integer or string ids",
            "timestamp": "integers",
            "rating": "numbers",
        }[c]
        if not ok:
            raise ValueError(f"{where}: column '{names[c]}' expected {expected}, got {kind}")
        if table.column(c).null_count:
            raise ValueError(
                f"{where}: column '{names[c]}' expected a value in every row, got {table.column(c).null_count} empty"
            )


_INT64_MAX = np.iinfo(np.int64).max


def _fits_int64(x: np.ndarray) -> bool:
    """Whether an integer column converts to int64 without wrapping (uint64 values of 2^63 and up do not)."""
    return x.dtype != np.uint64 or len(x) == 0 or int(x.max()) <= _INT64_MAX


def _to_interactions(table: pa.Table, name: str, names: dict[str, str] | None = None) -> Interactions:
    """The table's events, exact duplicates (same user, item and timestamp) dropped with one line on stderr:
    a duplicated event would make every held-out item the event just before it, a free hit."""
    _check_table(table, name, names)
    names = names or {c: c for c in COLUMNS}
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in COLUMNS}
    if not _fits_int64(cols["timestamp"]):
        raise ValueError(
            f"{name}: column '{names['timestamp']}' expected timestamps below 2^63, got {int(cols['timestamp'].max())}"
        )
    item_ids, item = np.unique(cols["item"], return_inverse=True)
    user, user_ids = cols["user"], None
    if not np.issubdtype(user.dtype, np.integer) or not _fits_int64(user):  # codes, the ids kept as they are
        user_ids, user = np.unique(user, return_inverse=True)
    rating = cols["rating"].astype(np.float64)
    if not np.isfinite(rating).all():
        raise ValueError(f"{name}: column '{names['rating']}' expected finite numbers")
    user, item, timestamp = user.astype(np.int64), item.astype(np.int64) + 1, cols["timestamp"].astype(np.int64)
    # Arrow's hash grouping, where numpy's unique over rows (a lexsort) took minutes for 20M events. On the calling
    # thread: Arrow's pool could release the numpy-backed key columns after the grouping had returned, and a
    # release during interpreter exit aborted the process (SIGABRT, "terminate called without an active exception":
    # 5 of 600 processes that loaded a small file six times, pyarrow 26.0.1; a core dump showed a pool thread
    # freeing the numpy buffer; none of 800 on one thread). One thread is also the faster here: 3.9 s against
    # 6-9 s threaded for 20M events on 2 cores.
    keys = pa.table({"u": user, "i": item, "t": timestamp, "row": np.arange(len(user))})
    first = keys.group_by(["u", "i", "t"], use_threads=False).aggregate([("row", "min")]).column("row_min").to_numpy()
    dropped = len(user) - len(first)
    if dropped:
        keep = np.sort(first)
        print(
            f"flexhstu: {name}: dropped {dropped} duplicate events (same user, item and timestamp; the first "
            "of each is kept)",
            file=sys.stderr,
        )
        user, item, rating, timestamp = user[keep], item[keep], rating[keep], timestamp[keep]
    return Interactions(user, item, rating, timestamp, len(item_ids), name, item_ids, user_ids, dropped)


def data_digest(data: Interactions) -> str:
    """A digest of the events and the file's ids: two loads of the same data give the same digest, any change
    of an event, an id or the order of events another (a run records it; ``--resume`` and ``recommend``
    compare)."""
    h = hashlib.sha256()
    for x in (data.user, data.item, data.timestamp, data.rating):
        h.update(np.ascontiguousarray(x).tobytes())
    for ids in (data.item_ids, data.user_ids):
        if ids is None:
            h.update(b"none")
        elif ids.dtype.kind in "iuf":
            h.update(ids.dtype.str.encode() + np.ascontiguousarray(ids).tobytes())
        else:  # strings (object arrays of str): each with its length, so no two lists join the same
            h.update(b"".join(len(b).to_bytes(8, "little") + b for b in (str(x).encode() for x in ids)))
    return h.hexdigest()


def parse_columns(text: str) -> dict[str, str]:
    """``user=uid,item=iid,time=ts[,rating=r]`` -> ``{"user": "uid", ...}`` (user, item and time required)."""
    mapping = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, column = (x.strip() for x in part.partition("="))
        if not sep or key not in MAPPED or not column:
            raise ValueError(
                f"--columns: expected comma-separated KEY=COLUMN with KEY in {', '.join(MAPPED)}, got '{part}'"
            )
        if key in mapping:
            raise ValueError(f"--columns: expected each key once, got '{key}' twice")
        if column in mapping.values():
            other = next(k for k, c in mapping.items() if c == column)
            raise ValueError(
                f"--columns: expected a different column for each key, got '{column}' for both {other} and {key}"
            )
        mapping[key] = column
    missing = [k for k in MAPPED[:3] if k not in mapping]
    if missing:
        raise ValueError(f"--columns: expected user, item and time (rating is optional), missing {', '.join(missing)}")
    return mapping


def _refuse_ints_beyond_int64(source: Path, table: pa.Table, columns: dict[str, str]) -> None:
    """Arrow reads a CSV column of integers that int64 cannot hold as doubles, which ``_check_table`` reported as
    "expected integers, got double". For an id or time column read as doubles, the first integer outside int64 is
    named instead (the column is read again as text: only on this error path)."""
    for key in ("user", "item", "time"):
        column = columns[key]
        if not pa.types.is_floating(table.schema.field(column).type):
            continue
        text = (
            pacsv.read_csv(
                source,
                convert_options=pacsv.ConvertOptions(include_columns=[column], column_types={column: pa.string()}),
            )
            .column(column)
            .to_pylist()
        )
        for row, value in enumerate(text, start=1):
            try:
                number = int(value.strip())
            except (AttributeError, ValueError):  # empty, or not an integer: _check_table's message says it
                continue
            if not INT64_RANGE[0] <= number <= INT64_RANGE[1]:
                raise ValueError(
                    f"{source}: column '{column}' (--columns {key}={column}) expected integers from "
                    f"-2^63 to 2^63 - 1 (int64), got {value.strip()} (data row {row})"
                )


def _read_mapped(source: Path, columns: dict[str, str]) -> Interactions:
    """A CSV or Parquet file of interactions whose columns ``columns`` names; a missing rating is 1.0."""
    try:
        if source.suffix == ".parquet":
            table = pq.read_table(source)
        elif source.suffix == ".csv":
            table = pacsv.read_csv(source)
        else:
            raise ValueError(f"{source}: expected a .csv or .parquet file with --columns, got '{source.suffix}'")
    except pa.ArrowException as e:
        raise ValueError(f"{source}: could not read it as {source.suffix[1:]} ({e})") from e
    for key, column in columns.items():
        if column not in table.column_names:
            raise ValueError(
                f"{source}: expected column '{column}' (--columns {key}={column}), missing (found {table.column_names})"
            )
    if source.suffix == ".csv":
        _refuse_ints_beyond_int64(source, table, columns)
    rating = table.column(columns["rating"]) if "rating" in columns else pa.array(np.ones(table.num_rows))
    picked = pa.table(
        {
            "user": table.column(columns["user"]),
            "item": table.column(columns["item"]),
            "rating": rating,
            "timestamp": table.column(columns["time"]),
        }
    )
    names = {
        "user": columns["user"],
        "item": columns["item"],
        "timestamp": columns["time"],
        "rating": columns.get("rating", "rating"),
    }
    return _to_interactions(picked, str(source), names)


def _write_cache(cols: dict[str, np.ndarray], target: Path) -> None:
    """Written as checkpoints are (``checkpoint.write_atomic``: a unique temporary file, synced, renamed over the
    target, the umask's mode): concurrent first loads each rename a complete file, and a crash leaves none half
    written."""
    from ..checkpoint import write_atomic

    write_atomic(target, lambda f: pq.write_table(pa.table(cols), f))


def _read_cache(target: Path) -> pa.Table | None:
    """The cached table, or None (with one line on stderr) when the file is unreadable or not ours."""
    try:
        table = pq.read_table(target)
        _check_table(table, str(target))
        return table
    except (pa.ArrowException, OSError, ValueError) as e:
        print(f"flexhstu: rebuilding the unreadable cache {target} ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def cache_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The data cache's folder, made if missing: ``cache_dir``, else ``$FLEXHSTU_CACHE`` (when set and not empty),
    else ``~/.cache/flexhstu``. An error names where the folder came from (a file there gave ``File exists``)."""
    if cache_dir is not None:
        arg, cache = "cache_dir", Path(cache_dir)
    elif os.environ.get("FLEXHSTU_CACHE"):
        arg, cache = "FLEXHSTU_CACHE", Path(os.environ["FLEXHSTU_CACHE"])
    else:
        arg, cache = "FLEXHSTU_CACHE (not set: ~/.cache/flexhstu)", Path.home() / ".cache" / "flexhstu"
    if cache.exists() and not cache.is_dir():
        raise ValueError(f"{arg}: expected a folder for the data cache, got '{cache}' (a file)")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{arg}: expected a folder for the data cache, got '{cache}' (it cannot be made: {e.strerror})"
        ) from e
    return cache


def load(data: str, cache_dir: str | os.PathLike | None = None, columns: dict[str, str] | None = None) -> Interactions:
    """``ml-100k``, ``synthetic``, a ratings file, or a Parquet file with the four columns; with ``columns``
    (``{"user": ..., "item": ..., "time": ..., "rating": ...}``, rating optional) any CSV or Parquet file.

    A ratings file is parsed once and cached as Parquet in ``cache_dir`` (default ``$FLEXHSTU_CACHE`` or
    ``~/.cache/flexhstu``), keyed by its path, size and modification time; a corrupt cache is rebuilt. A
    mapped file is read directly (pyarrow's readers are fast)."""
    if data == "synthetic":
        if columns:
            raise ValueError("--columns: expected a CSV or Parquet --data file, got --data synthetic")
        return synthetic()
    source = recbole_ml100k_path() if data == "ml-100k" else Path(data)
    if not source.is_file():
        why = "a folder: pass a file in it" if source.is_dir() else "no such file"
        raise FileNotFoundError(f"--data: expected ml-100k, synthetic or a ratings file, got '{data}' ({why})")
    if columns:
        return _read_mapped(source, columns)
    if source.suffix == ".parquet":
        try:
            table = pq.read_table(source)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{source}: expected a Parquet file, could not read it ({e})") from e
        return _to_interactions(table, str(source))
    cache = cache_folder(cache_dir)
    target = _cache_path(source, cache)
    table = _read_cache(target) if target.exists() else None
    if table is None:
        _write_cache(_read_raw(source), target)
        table = pq.read_table(target)
    return _to_interactions(table, data)


def synthetic(num_users: int = 300, num_items: int = 200, length: int = 40, seed: int = 0) -> Interactions:
    """The events of ``SyntheticSource(num_users, num_items, length, seed)`` in memory: users walk a hidden item
    cycle (the next item is usually ``item + 1``); ratings are high on the cycle and low off it."""
    from .synthetic_source import SyntheticSource

    source = SyntheticSource(num_users, num_items, length, seed)
    users = [source.user(u) for u in range(num_users)]
    cat = lambda k: np.concatenate([x[k] for x in users])
    return Interactions(
        np.repeat(np.arange(num_users), source.lengths),
        cat(0),
        cat(1),
        cat(2),
        num_items,
        "synthetic",
        np.arange(1, num_items + 1),
    )
