"""Several ranks: the synthetic source, the item table sharded across ranks (rowwise, fsdp), the memory
pre-check, sharded checkpoints (atomic, resumable on any number of ranks) and the tokens/s report."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from children import check_child, run_child, shown
from tiny_run import TINY as TINY_RUN

from flexhstu import checkpoint, distributed, train
from flexhstu.cli.common import UserError
from flexhstu.data import synthetic
from flexhstu.data.synthetic_source import SyntheticSource
from flexhstu.models import build_model

TINY = [*TINY_RUN, "--dropout", "0"]
HERE = Path(__file__).resolve().parent


def test_synthetic_users_are_generated_when_read_and_match_the_in_memory_data():
    src = SyntheticSource(50, 30, 12, seed=4)
    data = synthetic(50, 30, 12, seed=4)
    for u in (0, 17, 49):
        items, ratings, times = src.user(u)
        mine = data.user == u
        assert np.array_equal(items, data.item[mine]) and np.array_equal(times, data.timestamp[mine])
        assert np.array_equal(ratings, data.rating[mine]) and 6 <= len(items) <= 12
        assert np.all(np.diff(times) > 0) and items.min() >= 1 and items.max() <= 30
    big = SyntheticSource(10**6, 10**6, 4096)  # only the lengths are drawn up front
    assert big.lengths.nbytes == 8 * 10**6 and 2048 <= len(big.user(999_999)[0]) <= 4096
    steps = np.concatenate([np.diff(big.user(u)[0]) for u in range(20)])
    assert 0.8 < np.mean(steps == 1) < 0.9  # the planted next-item structure


def test_table_rows_depend_only_on_the_seed_and_the_row():
    whole = distributed.init_rows(torch.empty(3 * distributed.INIT_BLOCK_ROWS + 5, 4), 0, seed=3, std=0.5)
    for start, n in [(0, 10), (distributed.INIT_BLOCK_ROWS - 3, 7), (2 * distributed.INIT_BLOCK_ROWS + 1, 100)]:
        part = distributed.init_rows(torch.empty(n, 4), start, seed=3, std=0.5)
        assert torch.equal(part, whole[start : start + n])
    other = distributed.init_rows(torch.empty(10, 4), 0, seed=4, std=0.5)
    assert not torch.equal(other, whole[:10]) and abs(float(whole.std()) - 0.5) < 0.01
    # torch.chunk sizes, as DTensor's and FSDP2's Shard(0)
    assert [distributed.shard_range(11, 2, r) for r in (0, 1)] == [(0, 6), (6, 11)]
    assert [len(c) for c in torch.arange(11).chunk(3)] == [
        b - a for a, b in (distributed.shard_range(11, 3, r) for r in range(3))
    ]


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_rowwise_lookup_reads_and_trains_rows_as_nn_embedding_does(one_rank_group):
    sharded = distributed.ItemTable(50, 4, seed=1, mode="rowwise", mesh=distributed.table_mesh(torch.device("cpu")))
    whole = distributed.ItemTable(50, 4, seed=1)
    reference = torch.nn.Embedding(50, 4, padding_idx=0)
    with torch.no_grad():
        reference.weight.copy_(whole.weight)
    ids = torch.tensor([[3, 0, 49], [3, 7, 0]])  # a repeated row, the padding row 0
    g = torch.randn(2, 3, 4)
    for table in (sharded, whole, reference):
        out = table(ids)
        assert out.shape == (2, 3, 4) and torch.equal(out, reference.weight[ids].detach())
        (out * g).sum().backward()
    grad = sharded.weight.grad.to_local()
    assert torch.equal(grad, reference.weight.grad) and torch.equal(whole.weight.grad, reference.weight.grad)
    assert grad[0].abs().sum() == 0 and torch.allclose(grad[3], g[0, 0] + g[1, 0])


def test_sharded_ranks_rank_non_finite_target_scores_last_as_target_rank_does(one_rank_group):
    from flexhstu.metrics import target_rank
    from flexhstu.models import make_batch

    _, d, model, _ = sharded_run()
    model.eval()
    users = [0, 1, 2]
    items = [d.train_items[u] for u in users]
    batch = make_batch(items, [d.seqs.times[u][: len(items[i])] for i, u in enumerate(users)], 20, with_targets=False)
    targets = [int(d.valid[u]) for u in users]
    with torch.no_grad():
        model.encoder.items.weight[targets[0]] = math.nan  # one target's score is NaN
        model.encoder.items.weight[7] = math.nan  # and one other item's
        scores = model.scores(batch).float()
        want = [target_rank(scores[r], t, torch.from_numpy(s)) for r, (s, t) in enumerate(zip(items, targets))]
        assert distributed.sharded_ranks(model, batch, targets, items) == want
    assert want[0] == d.num_items - len(set(items[0].tolist()) - {targets[0]}) - 1  # last of the candidates


def test_table_memory_counts_the_table_its_gradient_and_adams_moments():
    rows, dim = 10**8 + 1, 128
    assert distributed.table_bytes(rows, dim, "none", 1) == 4 * rows * dim * 4
    assert distributed.table_bytes(rows, dim, "rowwise", 2) == 4 * (rows // 2 + 1) * dim * 4
    assert distributed.table_bytes(rows, dim, "fsdp", 2) == 4 * (rows // 2 + 1) * dim * 4 + 2 * rows * dim * 4
    distributed.check_table_memory(rows, dim, "rowwise", 2, int(150e9), "cuda:0")  # 102.4 GB fits an H200
    with pytest.raises(
        ValueError,
        match=r"needs 204\.8 GB per rank on 1 rank, got 150\.0 GB free on cuda:0; shard it "
        r"with --shard-embeddings rowwise over 2 or more ranks",
    ):
        distributed.check_table_memory(rows, dim, "none", 1, int(150e9), "cuda:0")


def test_a_table_that_cannot_fit_is_refused_in_one_line_before_anything_is_allocated(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(distributed, "free_bytes", lambda device: int(150e9))  # an empty H200

    def never(*args, **kwargs):
        raise AssertionError("the table was built")

    monkeypatch.setattr(distributed, "item_table", never)
    argv = [*TINY, "--synthetic-items", "100000000", "--dim", "128", "--out", str(tmp_path / "run")]
    assert train.cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "flexhstu train: error: --shard-embeddings none: expected an item table that fits: 100,000,001 x "
        "128 float32 with its gradient and AdamW's two moments needs 204.8 GB per rank on 1 rank, got "
        "150.0 GB free on cpu; shard it with --shard-embeddings rowwise over 2 or more ranks with this "
        "much memory"
    ], err


def test_tokens_per_second_are_written_and_printed(tmp_path, capsys):
    r = train.main(
        [t for t in TINY if t != "--quiet"]
        + ["--epochs", "1", "--steps-per-epoch", "4", "--eval-users", "50", "--out", str(tmp_path)]
    )
    t = json.loads((tmp_path / "metrics.json").read_text())["throughput"]
    assert t == r["throughput"] and t["ranks"] == 1 and t["steps"] == 4 and t["after_warmup"]["steps"] == 1
    assert t["tokens"] > 0 and t["tokens_per_s"] == pytest.approx(t["tokens"] / t["seconds"])
    assert t["each_rank"] == [pytest.approx(t["tokens_per_s"])]
    assert f"flexhstu train: {t['tokens_per_s']:,.0f} tokens/s on 1 rank" in capsys.readouterr().out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The latest weights of a run, whole, from either checkpoint format."""
    state = checkpoint.load(run / "checkpoint.pt")
    if "sharded" not in state:
        return state["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / state["sharded"], run / "whole.pt")
    return torch.load(run / "whole.pt", weights_only=True)["model"]


def test_sharded_and_unsharded_runs_train_the_same_parameters_and_resume_on_any_number_of_ranks(tmp_path):
    """Two gloo ranks: the whole table (DDP), rowwise and fsdp; a rowwise run stopped after an epoch, resumed on two
    ranks and (below) on one. Every run must end with the parameters of one uninterrupted process."""
    runs = {m: tmp_path / m for m in ("none", "rowwise", "fsdp", "resumed2", "resumed1")}
    steps = [
        {"argv": [*TINY, "--epochs", "2", "--shard-embeddings", m, "--out", str(runs[m])]}
        for m in ("none", "rowwise", "fsdp")
    ]
    stopped = [*TINY, "--epochs", "2", "--shard-embeddings", "rowwise"]
    steps += [
        {"argv": stopped + ["--stop-after", "1", "--out", str(runs["resumed2"])]},
        {"copy": [str(runs["resumed2"]), str(runs["resumed1"])]},
        {"argv": stopped + ["--resume", "--out", str(runs["resumed2"])]},
    ]
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "dist_runs.py"),
        str(tmp_path / "steps.json"),
    ]
    check_child(cmd, env=env)
    state = checkpoint.load(runs["rowwise"] / "checkpoint.pt")  # only the folders it names are kept
    assert sorted(p.name for p in (runs["rowwise"] / "sharded").iterdir()) == sorted(
        {Path(state["sharded"]).name, Path(state["best"]["dir"]).name}
    )
    train.main(stopped + ["--resume", "--out", str(runs["resumed1"])])  # one rank reads the two ranks' shards
    one = train.main([*TINY, "--epochs", "2", "--out", str(tmp_path / "one")])

    want = _weights(tmp_path / "one")
    for name, run in runs.items():
        got = _weights(run)
        assert got.keys() == want.keys(), name
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m, n=name, k=k: f"{n} {k}: {m}"
            )
        result = json.loads((run / "metrics.json").read_text())
        assert [h["loss"] for h in result["history"]] == pytest.approx([h["loss"] for h in one["history"]], rel=1e-5)
        for metric, value in one["test"].items():  # a near-tie may fall the other way: one user of 300
            assert abs(result["test"][metric] - value) <= 1 / 300 + 1e-9, (name, metric)
    sums = [json.loads((runs["rowwise"] / f"rank{r}.json").read_text())["checksum"] for r in (0, 1)]
    assert sums[0] == sums[1]


# Saves a sharded run's checkpoint after "epoch" 1, 2, 3, ... (table filled with the epoch; a new best every third),
# through train.save_checkpoint, forever.
SAVER = """
import sys, torch
from pathlib import Path
from flexhstu import train
from test_distributed import sharded_run
a, d, model, opt = sharded_run()
p = train.Progress()
for epoch in range(1, 10**9):
    with torch.no_grad():
        model.encoder.items.weight.fill_(epoch)
    p.epoch, new_best = epoch, epoch % 3 == 1
    if new_best:
        p.best = {"score": epoch, "epoch": epoch, "model": None}
    train.save_checkpoint(a, d, Path(sys.argv[1]), model, opt, p, new_best, rank=0)
    print(epoch, flush=True)
"""


def sharded_run():
    """Arguments, data, model and optimizer of a small run saved in the sharded format (one process)."""
    a = train.parse([*TINY, "--shard-embeddings", "rowwise"])
    d = train.prepare_data(a)
    model = build_model(train.model_config(a), d.num_items, items=distributed.ItemTable(d.num_items + 1, a.dim))
    return a, d, model, torch.optim.AdamW(train.param_groups(a, model))


def test_a_sharded_checkpoint_killed_mid_save_leaves_a_complete_one(tmp_path):
    rng = random.Random(0)
    _, _, model, opt = sharded_run()
    table = model.encoder.items.weight
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):  # each start costs seconds (imports); a save takes tens of milliseconds
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
        )
        proc.stdout.readline()  # one commit done: the next ones replace a complete checkpoint
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = checkpoint.load(tmp_path / "checkpoint.pt")
        checkpoint.load_sharded(tmp_path / state["sharded"], model, opt)
        assert torch.equal(table, torch.full_like(table, state["epoch"]))
        checkpoint.load_sharded(tmp_path / state["best"]["dir"], model)
        assert torch.equal(table, torch.full_like(table, state["best"]["epoch"]))


def test_a_sharded_run_resumes_only_with_its_sharding_and_its_folders(tmp_path):
    out = tmp_path / "run"
    argv = [*TINY, "--epochs", "2", "--shard-embeddings", "rowwise", "--out", str(out)]
    train.main(argv + ["--stop-after", "1"])  # one rank: a whole table, saved in the sharded format
    state = checkpoint.load(out / "checkpoint.pt")
    assert state["sharded"] == "sharded/epoch-0001" and "model" not in state
    with pytest.raises(UserError, match="--shard-embeddings 'rowwise' in the checkpoint, 'none' now"):
        train.main([*TINY, "--epochs", "2", "--resume", "--out", str(out)])
    for f in (out / state["sharded"]).iterdir():
        f.unlink()
    with pytest.raises(UserError, match=r"sharded/epoch-0001: expected a complete sharded checkpoint"):
        train.main(argv + ["--resume"])


def test_a_folder_refused_on_rank_0_stops_every_rank(tmp_path):
    # Review: rank 0 raised (the folder is locked by another run) while rank 1 went on to wait for it in the
    # first collective, until the launcher tore the job down.
    out = tmp_path / "locked"
    out.mkdir()
    train.lock_run(out)
    try:  # a rank left waiting would hold the launch until gloo's 30-minute timeout: run_child's ends it first
        done = run_child(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "flexhstu.train",
                *TINY,
                "--epochs",
                "1",
                "--out",
                str(out),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        train.unlock_run(out)
    assert done.returncode != 0, shown(done)
    assert (
        done.stderr.count("flexhstu train: error: --out: expected a folder no other flexhstu train is writing") == 2
    ), shown(done)  # each rank says it in one line


def test_a_child_that_fails_or_hangs_is_shown_with_its_output():
    # A torchrun test failed once on a loaded machine with the ranks' output captured and never shown.
    fails = [sys.executable, "-c", "import sys; print('rank said this'); sys.exit('and this on stderr')"]
    with pytest.raises(AssertionError) as e:
        check_child(fails)
    assert "exit status 1" in str(e.value) and "rank said this" in str(e.value) and "and this on stderr" in str(e.value)
    hangs = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; print('started', flush=True); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)",
    ]
    with pytest.raises(pytest.fail.Exception, match=r"ran past 5 s and was killed(.|\n)*started"):
        run_child(hangs, timeout=5)
