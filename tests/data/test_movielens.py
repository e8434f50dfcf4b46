"""Ratings files: exact parsing, a cache that survives concurrent first loads and corruption."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from flexhstu.data import load


def _csv(tmp_path, rows: list[str]):
    f = tmp_path / "ratings.csv"
    f.write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows) + "\n")
    return f


def test_ids_are_parsed_exactly_as_integers(tmp_path):
    big = 2**53
    d = load(
        str(_csv(tmp_path, [f"{big},1,4,10", f"{big + 1},2,3,11", "7,3,5,9223372036854775807"])),
        cache_dir=tmp_path / "cache",
    )
    assert d.user.tolist() == [big, big + 1, 7]  # through float64 both users were 2^53
    assert d.timestamp.tolist() == [10, 11, 2**63 - 1]


@pytest.mark.parametrize(
    "row,column,got",
    [
        ("1.5,2,4,10", "user", "1.5"),
        ("nan,2,4,10", "user", "nan"),
        ("1,2e3,4,10", "item", "2e3"),
        ("1,2,4,10.25", "timestamp", "10.25"),
        ("1,2,4,9223372036854775808", "timestamp", "9223372036854775808"),
        ("1,2,nan,10", "rating", "nan"),
        ("1,2,inf,10", "rating", "inf"),
        ("1,2,4", "timestamp", ""),
    ],
)
def test_a_bad_value_names_the_file_the_line_and_the_column(tmp_path, row, column, got):
    f = _csv(tmp_path, ["1,1,4,5", row])
    kind = "a finite number" if column == "rating" else "an integer"
    with pytest.raises(ValueError, match=f"ratings.csv, line 3, column '{column}': expected {kind}, got '{got}'"):
        load(str(f), cache_dir=tmp_path / "cache")


# Each process waits for the round's "go" file, then loads into that round's fresh cache folder.
LOADER = """
import os, sys, time
from pathlib import Path
from flexhstu.data import load
src, root, rounds, me = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
(root / f"ready-{me}").touch()
for r in range(rounds):
    while not (root / f"go-{r}").exists():
        time.sleep(0.001)
    d = load(src, cache_dir=root / f"cache-{r}")
    assert len(d) == 2000, len(d)
    (root / f"done-{r}-{me}").touch()
"""


def test_concurrent_first_loads_into_a_fresh_cache_all_succeed(tmp_path):
    rng = np.random.default_rng(0)
    src = _csv(
        tmp_path,
        [f"{u},{i},4,{t}" for u, i, t in zip(rng.integers(0, 50, 2000), rng.integers(0, 300, 2000), range(2000))],
    )
    procs, rounds = 4, 6
    root = tmp_path / "runs"
    root.mkdir()
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER, str(src), str(root), str(rounds), str(k)], stderr=subprocess.PIPE, text=True
        )
        for k in range(procs)
    ]
    try:
        while len(list(root.glob("ready-*"))) < procs:
            time.sleep(0.01)
            assert all(p.poll() is None for p in ps), [p.stderr.read() for p in ps]
        for r in range(rounds):
            (root / f"go-{r}").touch()
            while len(list(root.glob(f"done-{r}-*"))) < procs and all(p.poll() is None for p in ps):
                time.sleep(0.005)
    finally:
        errors = [p.communicate(timeout=60)[1] for p in ps]
    assert [p.returncode for p in ps] == [0] * procs, errors
    for r in range(rounds):
        files = sorted(p.name for p in (root / f"cache-{r}").iterdir())
        assert len(files) == 1 and files[0].endswith(".parquet"), files  # no temporary file left behind


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_a_corrupt_cache_is_reported_and_rebuilt(tmp_path, capsys, damage):
    src = _csv(tmp_path, ["1,10,4,100", "1,20,3,50", "2,10,5,70"])
    want = load(str(src), cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("*.parquet")
    if damage == "truncate":
        cached.write_bytes(cached.read_bytes()[:40])
    elif damage == "garbage":
        cached.write_bytes(b"\x00garbage" * 100)
    else:
        pq.write_table(pq.read_table(cached).drop(["rating"]), cached)
    capsys.readouterr()
    got = load(str(src), cache_dir=tmp_path / "cache")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flexhstu: rebuilding the unreadable cache {cached}")
    for c in ("user", "item", "rating", "timestamp"):
        assert np.array_equal(getattr(got, c), getattr(want, c))
    assert pq.read_table(cached).num_rows == 3  # the cache itself is whole again
    load(str(src), cache_dir=tmp_path / "cache")
    assert capsys.readouterr().err == ""


def test_an_unreadable_parquet_data_file_gets_a_clear_error(tmp_path):
    f = tmp_path / "events.parquet"
    f.write_bytes(b"PAR1 but not really")
    with pytest.raises(ValueError, match=r"events\.parquet: expected a Parquet file, could not read it"):
        load(str(f))


def _events(tmp_path, name="events.csv"):
    f = tmp_path / name
    f.write_text("ts,uid,iid,stars,extra\n10,alice,m9,4,x\n12,bob,m3,5,y\n11,alice,m3,2,z\n13,alice,m1,1,w\n")
    return f


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_any_csv_or_parquet_is_read_through_a_column_mapping(tmp_path, fmt):
    import pyarrow.csv as pacsv

    f = _events(tmp_path)
    if fmt == "parquet":
        pq.write_table(pacsv.read_csv(f), tmp_path / "events.parquet")
        f = tmp_path / "events.parquet"
    d = load(str(f), columns={"user": "uid", "item": "iid", "time": "ts", "rating": "stars"})
    assert d.user_ids.tolist() == ["alice", "bob"] and d.user.tolist() == [0, 1, 0, 0]
    assert d.item_ids.tolist() == ["m1", "m3", "m9"] and d.item.tolist() == [3, 2, 2, 1]
    assert d.timestamp.tolist() == [10, 12, 11, 13] and d.rating.tolist() == [4.0, 5.0, 2.0, 1.0]
    unrated = load(str(f), columns={"user": "uid", "item": "iid", "time": "ts"})
    assert unrated.rating.tolist() == [1.0] * 4


@pytest.mark.parametrize(
    "columns,msg",
    [
        (
            {"user": "uid", "item": "movie", "time": "ts"},
            r"events.csv: expected column 'movie' \(--columns item=movie\), "
            r"missing \(found \['ts', 'uid', 'iid', 'stars', 'extra'\]\)",
        ),
        ({"user": "uid", "item": "iid", "time": "extra"}, r"events.csv: column 'extra' expected integers, got string"),
        (
            {"user": "uid", "item": "iid", "time": "ts", "rating": "extra"},
            r"events.csv: column 'extra' expected numbers, got string",
        ),
    ],
)
def test_a_mapped_file_names_itself_and_the_bad_column(tmp_path, columns, msg):
    with pytest.raises(ValueError, match=msg):
        load(str(_events(tmp_path)), columns=columns)


@pytest.mark.parametrize("key,column", [("user", "uid"), ("item", "iid"), ("time", "ts")])
def test_an_integer_beyond_int64_in_a_mapped_csv_is_named_as_out_of_range(tmp_path, key, column):
    # Guards against: an id of 99999999999999999999 was reported as "expected integers, got double" (Arrow reads a
    # column of integers that int64 cannot hold as doubles).
    big = "99999999999999999999"
    rows = {"uid": ["1", "2", "1"], "iid": ["7", "8", "8"], "ts": ["10", "11", "12"]}
    rows[column][1] = big
    f = tmp_path / "events.csv"
    f.write_text("uid,iid,ts\n" + "".join(f"{u},{i},{t}\n" for u, i, t in zip(*rows.values())))
    with pytest.raises(ValueError) as e:
        load(str(f), columns={"user": "uid", "item": "iid", "time": "ts"})
    assert str(e.value) == (
        f"{f}: column '{column}' (--columns {key}={column}) expected integers from -2^63 to "
        f"2^63 - 1 (int64), got {big} (data row 2)"
    )


def test_an_integer_beyond_int64_in_a_ratings_file_says_so(tmp_path):
    f = tmp_path / "ratings.csv"
    f.write_text("userId,movieId,rating,timestamp\n1,10,4.5,100\n-99999999999999999999,10,4.5,100\n")
    with pytest.raises(
        ValueError,
        match=r"line 3, column 'user': expected an integer, got '-99999999999999999999' "
        r"\(outside the int64 range\)$",
    ):
        load(str(f), cache_dir=tmp_path / "cache")


def test_column_mappings_are_parsed_and_checked():
    from flexhstu.data.movielens import parse_columns

    assert parse_columns("user=uid, item=iid,time=ts,rating=r") == {
        "user": "uid",
        "item": "iid",
        "time": "ts",
        "rating": "r",
    }
    for bad, msg in (
        ("user=uid,item=iid", "missing time"),
        ("user=uid,item=iid,time=ts,score=s", "KEY in"),
        ("user=uid,user=u2,item=i,time=t", "'user' twice"),
        ("user,item=i,time=t", "got 'user'"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_columns(bad)


def test_exact_duplicate_events_are_dropped_and_reported(tmp_path, capsys):
    # Kept, the duplicate of each user's held-out last event would be trained on: HR@10 = 1.0 on a doubled file.
    rows = ["1,10,4,100", "1,11,3,101", "1,10,5,100", "2,10,4,100", "1,11,3,101", "1,11,3,102"]
    d = load(str(_csv(tmp_path, rows)), cache_dir=tmp_path / "cache")
    assert "dropped 2 duplicate events (same user, item and timestamp" in capsys.readouterr().err
    assert d.user.tolist() == [1, 1, 2, 1] and d.timestamp.tolist() == [100, 101, 100, 102]
    assert d.rating.tolist() == [4.0, 3.0, 4.0, 3.0]  # the first of each duplicate is kept
    load(str(_csv(tmp_path, rows[:2])), cache_dir=tmp_path / "cache")
    assert "duplicate" not in capsys.readouterr().err


def test_uint64_ids_above_int64_keep_their_values_and_huge_timestamps_are_refused(tmp_path):
    import pyarrow as pa

    big = 2**63 + 5  # cast to int64, this id would wrap to a negative number
    f = tmp_path / "events.parquet"
    pq.write_table(
        pa.table(
            {
                "user": pa.array([big, 3], pa.uint64()),
                "item": pa.array([big, 1], pa.uint64()),
                "rating": [1.0, 2.0],
                "timestamp": pa.array([1, 2], pa.uint64()),
            }
        ),
        f,
    )
    d = load(str(f))
    assert d.user_ids.tolist() == [3, big] and d.user.tolist() == [1, 0]
    assert d.item_ids.tolist() == [1, big] and d.item.tolist() == [2, 1]
    pq.write_table(
        pa.table({"user": [1], "item": [1], "rating": [1.0], "timestamp": pa.array([2**63], pa.uint64())}), f
    )
    with pytest.raises(
        ValueError,
        match=r"events.parquet: column 'timestamp' expected timestamps below 2\^63, got "
        r"9223372036854775808",
    ):
        load(str(f))


def test_the_data_digest_follows_the_contents_not_the_file():
    from flexhstu.data import Interactions, data_digest

    def data(user, item_ids=("a", "b")):
        return Interactions(
            np.array(user),
            np.array([1, 2, 1]),
            np.ones(3),
            np.array([5, 6, 7]),
            2,
            "x",
            np.array(item_ids, dtype=object),
        )

    same = data_digest(data([0, 0, 1]))
    assert data_digest(data([0, 0, 1])) == same
    assert data_digest(data([0, 1, 1])) != same  # relabelled users, same size
    assert data_digest(data([0, 0, 1], ("a", "c"))) != same
    assert data_digest(data([0, 0, 1], ("ab", ""))) != data_digest(data([0, 0, 1], ("a", "b")))


def test_one_column_for_two_keys_is_refused():
    from flexhstu.data.movielens import parse_columns

    with pytest.raises(
        ValueError, match="--columns: expected a different column for each key, got 'uid' for both user and item"
    ):
        parse_columns("user=uid,item=uid,time=ts")


def test_a_folder_given_as_data_is_named_a_folder(tmp_path):
    # A folder is named a folder, not "no such file".
    with pytest.raises(FileNotFoundError, match=r"got '.*' \(a folder: pass a file in it\)"):
        load(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"got '.*nothing.csv' \(no such file\)"):
        load(str(tmp_path / "nothing.csv"))


def test_the_cache_is_written_with_the_mode_a_plain_write_would_get(tmp_path):
    # The Parquet cache is not a mkstemp file (mode 0600), and it is synced before its rename.
    import os

    load(str(_csv(tmp_path, ["1,10,4,100", "1,11,3,101"])), cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("*.parquet")
    umask = os.umask(0o022)
    os.umask(umask)
    assert cached.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cached.name]  # no temporary file left
