"""Serving benchmark: cached delta scoring of OneRank candidates against a full recompute, on a CUDA GPU.

Every user has a history of ``--hist`` tokens and ``--cands`` candidates; a candidate is a group of 4 tokens
(the candidate and the model's three task tokens, OneRank). The model is ``OneRankModel`` with random
weights: ``--layers`` STU layers of width ``--dim`` and ``--heads`` heads.

**Scoring** rows, one per configuration and path:

* ``cached``: the users' histories are cached once (``cache_histories``), outside the timed region; a sample
  is one ``score_cached`` call: the request's histories gathered, then one delta attention call per layer and
  micro-batch of ``--micro-batch`` candidates per user (``all``: every candidate at once), micro-batches
  replayed from CUDA graphs kept across requests where the default takes them (``serving.GRAPH_MAX_ROWS``);
  ``cached, eager``: the same without CUDA graphs, ``cached, graphs``: with them forced, where the default does
  not take them (on CUDA, micro-batched rows only); ``cached, e4m3``: the default path with the attention in
  e4m3 (``score_cached(..., fp8=True)``; ``rel diff`` then shows e4m3's error against the full recompute);
* ``full``: a sample is the model's forward over history and candidates, what serving without a cache runs
  (micro-batch ``-``: every candidate in one forward; ``m``: one forward per micro-batch of ``m`` candidates per
  user, each recomputing the histories: what a server that cannot hold a request's candidates at once pays).

A sample is one request, timed with CUDA events from an idle device (synchronised before each) after
``--warmup`` calls. Rows give the median and p99 (nearest rank) latency of ``--samples`` samples,
candidates per second (``users * cands / median``) and ``rel diff``: the largest difference between the
cached and the full recompute's scores, over the largest full score (both paths must give the same scores).
Both paths run eager PyTorch around the Triton kernels (the STU layers are built with ``compile=False``),
so they compare the work each path does.

**Kernel** rows, one per history, micro-batch size ``m`` and number of users: the attention of one
micro-batch (the ``4 m`` rows of each user's candidates as queries, against the history and those rows)
with the model's heads and head dim. TFLOP/s on visible pairs, counted exactly (``masks.count_visible``;
a forward is ``4 * pairs * D``), from device time (CUDA-graph replays, ``triton.testing.do_bench``):

* ``delta``: ``delta_hstu_mha`` on the query rows;
* ``delta, e4m3``: the same in e4m3 (``flexhstu.quantize_fp8``, done before the timed calls, as a cache of
  e4m3 K and V would hold them), the same pairs;
* ``full, same pairs``: the training forward kernel (``hstu_mha``) on the whole sequences, under a func that
  gives history rows no keys: exactly the delta's pairs, so the two times compare directly;
* ``full, onerank``: ``hstu_mha`` on the whole sequences under the OneRank func (history rows included),
  the attention of a full recompute.

**AOTI** (``--aoti``, instead of the above): per layer count, one micro-batch module
(``serving.MicroBatchScorer``) exported with dynamic sizes and compiled with AOTInductor
(``serving.compile_scorer``); per history, users and micro-batch size, its scores are compared with eager
(largest difference over the largest eager score: at most 1e-2 in half precision, 1e-5 in float32; exit
status 1 otherwise) and both are timed as above.

An out-of-memory error or an input the library refuses is reported in the row's status, not raised.
``--json`` is rewritten after every row, so an interrupted run keeps what it measured.

This module is the command (options, progress, output); the parts are measured in ``serving_scoring``,
``serving_kernel`` and ``serving_aoti``, on the model and inputs of ``serving_setup``, and printed by
``report``.

    python -m flexhstu.bench.serving --quick --json serving.json     # history 16384, 2048 candidates, 4 layers
    python -m flexhstu.bench.serving --hist 4096 --json serving-4k.json   # a slice of the full grid
    python -m flexhstu.bench.serving --aoti --quick --json aoti.json
    flexhstu bench --serving --quick                                 # the same, through the command
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch

from ..cli.common import Parser, non_negative_int, positive_int
from ..ops import Kernel
from .report import aoti_table, kernel_table, scoring_table
from .serving_aoti import aoti_rows
from .serving_kernel import kernel_rows
from .serving_scoring import scoring_rows
from .serving_setup import FULL, GROUP, QUICK, Grid, Setup


def positive_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, e.g. ``4096,16384``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got '{text}'")
    return [positive_int(x) for x in parts]


def micro_batch_list(text: str) -> list[int | None]:
    """argparse type: comma-separated micro-batch sizes, integers >= 1 or ``all``, e.g. ``64,256,all``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or any(x != "all" and not (x.isdigit() and int(x) >= 1) for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 or 'all', got '{text}'")
    return [None if x == "all" else int(x) for x in parts]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="flexhstu bench --serving", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="a representative subset: history 16384, 2048 candidates, "
        "4 layers, micro-batches 256 and all, 1 and 8 users (options given still apply)",
    )
    p.add_argument("--aoti", action="store_true", help="compare an AOTInductor-compiled micro-batch with eager")
    p.add_argument(
        "--part",
        choices=["all", "scoring", "kernel"],
        default="all",
        help="without --aoti: the scoring rows, the kernel rows, or both",
    )
    p.add_argument("--hist", type=positive_list, default=None, help="history lengths (default 4096,16384)")
    p.add_argument("--cands", type=positive_list, default=None, help="candidates per user (default 512,2048)")
    p.add_argument(
        "--micro-batch",
        type=micro_batch_list,
        default=None,
        help="candidates per user per delta call, or all (default 64,256,all)",
    )
    p.add_argument("--layers", type=positive_list, default=None, help="STU layers (default 2,4,8)")
    p.add_argument("--users", type=positive_list, default=None, help="users per request (default 1,8,32)")
    p.add_argument("--dim", type=positive_int, default=512, help="embedding dim of the model")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (head dim: dim / heads)")
    p.add_argument("--samples", type=positive_int, default=30, help="timed requests per row")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed requests before them")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument(
        "--backend",
        choices=["triton", "pytorch"],
        default="triton",
        help="the attention kernels (pytorch: the reference)",
    )
    p.add_argument("--device", default="cuda", help="cuda; cpu only runs the code path (for tests)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", default="", help="also write the rows here (rewritten after every row)")
    a = p.parse_args(argv)
    defaults = QUICK if a.quick else FULL
    for name in Grid._fields:
        if getattr(a, name) is None:
            setattr(a, name, getattr(defaults, name))
    if a.dim % a.heads:
        p.error(f"--heads: expected a divisor of --dim {a.dim}, got {a.heads}")
    if a.device not in ("cuda", "cpu"):
        p.error(f"--device: expected cuda or cpu, got '{a.device}'")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device: expected a CUDA GPU, found none (--device cpu only runs the code path, for tests)")
    return a


def progress(row) -> str:
    """One line per finished row: its fields (floats to 4 digits), then its status."""
    fields = asdict(row)
    if fields.get("path") == "cached" and fields.get("cands") and fields["micro_batch"] is None:
        fields["micro_batch"] = "all"
    shown = [
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in fields.items()
        if k not in ("part", "status") and v is not None
    ]
    return " ".join(shown) + f" [{row.status}]"


def environment(setup: Setup) -> dict:
    where = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    return {
        "device": where,
        "torch": torch.__version__,
        "dtype": str(setup.dtype).replace("torch.", ""),
        "backend": setup.backend.value,
        "dim": setup.dim,
        "heads": setup.heads,
        "group_size": GROUP,
        "samples": setup.samples,
        "warmup": setup.warmup,
    }


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    setup = Setup(
        device=torch.device(a.device),
        dtype=getattr(torch, a.dtype),
        backend=Kernel(a.backend),
        dim=a.dim,
        heads=a.heads,
        samples=a.samples,
        warmup=a.warmup,
        seed=a.seed,
    )
    grid = Grid(**{name: getattr(a, name) for name in Grid._fields})
    env = environment(setup)
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    parts: list[tuple[str, Iterator, Callable[[list], str]]]
    if a.aoti:
        parts = [("aoti", aoti_rows(grid, setup), aoti_table)]
    else:
        parts = []
        if a.part in ("all", "scoring"):
            parts.append(("scoring", scoring_rows(grid, setup), scoring_table))
        if a.part in ("all", "kernel"):
            parts.append(("kernel", kernel_rows(grid, setup), kernel_table))
    done: dict[str, list] = {name: [] for name, _, _ in parts}
    t_start = time.perf_counter()
    for name, rows, _ in parts:
        for row in rows:
            done[name].append(row)
            print(f"{name}: {progress(row)} ({time.perf_counter() - t_start:.0f} s)", flush=True)
            if a.json:
                with open(a.json, "w") as fh:
                    json.dump({"env": env, "rows": [asdict(r) for rs in done.values() for r in rs]}, fh, indent=1)
    for name, _, table in parts:
        print(f"\n{name}:\n\n{table(done[name])}")
    failed = [r for r in done.get("aoti", []) if r.passed is False]
    if failed:
        print(f"{len(failed)} AOTI row(s) differ from eager beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
