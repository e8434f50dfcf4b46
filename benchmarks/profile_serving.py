"""Where a cached scoring request spends its time, and how far bf16 scores are from float32 (H200).

    PYTHONPATH=$PWD python3 benchmarks/profile_serving.py [--users 1] [--micro-batch 256] [--out DIR]

The model and inputs of ``flexhstu.bench.serving`` (OneRank, 4 STU layers of 512, history 16384, 2048
candidates of group size 4). Prints:

* per path (full recompute, cached in micro-batches, cached all at once): wall time per request, host time
  spent waiting on the device (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/pageable copies), the number
  of kernels launched, and the top operators by host time and by device time (``torch.profiler``), with a
  Chrome trace per path under ``--out``;
* accuracy: each bf16 path's scores against the float32 full recompute's (``max |x - ref| / max |ref|``), so the
  difference between two bf16 paths can be read against what bf16 itself costs.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flexhstu import Kernel
from flexhstu.bench import serving_setup as bs
from flexhstu.serving import HistoryCache

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize")


def paths(model, setup, users: int, hist: int, cands: int, micro_batch: int):
    histories = bs.make_histories(setup, users=users, hist=hist)
    cand_items, cand_offsets = bs.make_candidates(setup, users=users, cands=cands)
    max_seq_len = hist + bs.GROUP * cands
    cache = HistoryCache(num_layers=len(model.stack.layers), max_seq_len=max_seq_len)
    names = list(range(users))
    with torch.no_grad():
        model.cache_histories(cache, names, *histories)
    return {
        "full": functools.partial(model, *histories, cand_items, cand_offsets, max_seq_len=max_seq_len),
        f"cached {micro_batch}": functools.partial(
            model.score_cached, cache, names, cand_items, cand_offsets, micro_batch=micro_batch
        ),
        "cached all": functools.partial(model.score_cached, cache, names, cand_items, cand_offsets),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--users", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--hist", type=int, default=16384)
    p.add_argument("--cands", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (PyTorch reference kernels)")
    p.add_argument("--out", default="/tmp/profile-serving")
    a = p.parse_args()
    cuda = a.device == "cuda"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = bs.Setup(
        device=torch.device(a.device),
        dtype=torch.bfloat16,
        dim=a.dim,
        heads=4,
        samples=10,
        warmup=3,
        backend=Kernel.TRITON if cuda else Kernel.PYTORCH,
        seed=0,
    )
    model = bs.build_model(setup, layers=a.layers, max_hist=a.hist)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    calls = paths(model, setup, a.users, a.hist, a.cands, a.micro_batch)
    scores = {}
    with torch.no_grad():
        for name, call in calls.items():
            for _ in range(3):
                scores[name] = call()
            sync()
            t0 = time.perf_counter()
            for _ in range(5):
                call()
            sync()
            wall = (time.perf_counter() - t0) / 5 * 1e3
            with profile(activities=activities) as prof:
                call()
                sync()
            events = prof.key_averages()
            waits = {e.key: (e.count, e.cpu_time_total / 1e3) for e in events if e.key in WAITS}
            kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"\n## {name}: {wall:.2f} ms per request (wall, 5 requests), {kernels} device ops in one")
            print(
                "host calls that can wait on the device (count, ms): "
                + ", ".join(f"{k} {c} {t:.2f}" for k, (c, t) in waits.items())
            )
            print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
            if cuda:
                print(events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
            prof.export_chrome_trace(str(out / f"trace-{name.replace(' ', '-')}.json"))
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference: IEEE dots in torch and in the kernels
    model32 = model.float()
    calls32 = paths(model32, setup._replace(dtype=torch.float32), a.users, a.hist, a.cands, a.micro_batch)
    with torch.no_grad():
        ref = calls32["full"]().float()
        print("\n## accuracy against the float32 full recompute (max |x - ref| / max |ref|)")
        for name, s in scores.items():
            print(f"bf16 {name:14} {bs.rel_diff(s, ref):.2e}")
        s32 = calls32[f"cached {a.micro_batch}"]()
        print(f"fp32 cached {a.micro_batch:<7} {bs.rel_diff(s32, ref):.2e}")
        between = bs.rel_diff(scores[f"cached {a.micro_batch}"], scores["full"])
        print(f"bf16 cached {a.micro_batch} vs bf16 full: {between:.2e}")


if __name__ == "__main__":
    main()
