"""The serving benchmark's kernel rows: the delta attention of one micro-batch against the training forward
kernel on the same pairs and on the whole OneRank mask, in device time and TFLOP/s on visible pairs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import delta_hstu_mha, hstu_mha, masks, quantize_fp8
from ..jagged import offsets_from_lengths, row_coords
from .serving_setup import GROUP, Grid, Setup, device_ms, free, reported


@dataclass
class KernelRow:
    kernel: str  # "delta", "delta, e4m3", "full, same pairs", "full, onerank"
    hist: int
    cands: int  # per user in the micro-batch: 4x as many query rows
    users: int
    heads: int
    head_dim: int
    pairs: int | None = None  # visible (query, key) pairs, all heads
    ms: float | None = None  # device time: median of CUDA-graph replays (CPU: wall time)
    tflops: float | None = None  # 4 * pairs * head_dim / time
    eager_ms: float | None = None  # an eager call, host work included
    status: str = "ok"
    part: str = "kernel"


def kernel_rows(grid: Grid, setup: Setup) -> Iterator[KernelRow]:
    """The delta kernel against the training forward kernel, per history, users and micro-batch size."""
    for hist in grid.hist:
        for users in grid.users:
            for cands in grid.per_user_cands():
                yield from _kernel_case(setup, hist=hist, cands=cands, users=users)
                free(setup.device)


class KernelCalls(NamedTuple):
    """The attention calls of one kernel case and the visible pairs (all heads) of each."""

    calls: dict[str, Callable[[], torch.Tensor]]
    pairs: dict[str, int]


def kernel_calls(setup: Setup, *, hist: int, cands: int, users: int) -> KernelCalls:
    """``users`` sequences of ``hist`` history rows and ``cands`` candidate groups under the OneRank func; the
    delta call takes the groups' rows as queries (the last ``4 * cands`` rows of every sequence), in the setup's
    dtype and in e4m3 (``flexhstu.quantize_fp8``, outside the timed call: a cache holds K and V so)."""
    heads, head_dim = setup.heads, setup.dim // setup.heads
    length = hist + GROUP * cands
    offs = offsets_from_lengths([length] * users, device=setup.device)
    total = users * length
    g = torch.Generator(device=setup.device).manual_seed(setup.seed)
    q, k, v = (
        torch.randn(total, heads, head_dim, device=setup.device, dtype=setup.dtype, generator=g) for _ in range(3)
    )
    targets = torch.full((users,), GROUP * cands, dtype=torch.int64, device=setup.device)
    func = masks.onerank(offs, targets, GROUP, total=total)  # (1, 5, total)
    _, local, _ = row_coords(offs, total)
    history_row = local < hist
    same_pairs = torch.where(history_row, 0, func)  # history rows: every interval [0, 0), no keys
    new_rows = torch.nonzero(~history_row).squeeze(1)  # the groups' rows, user by user
    delta_q, delta_func = q[new_rows].contiguous(), func[:, :, new_rows].contiguous()
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(x) for x in (delta_q, k, v))
    calls = {
        "delta": functools.partial(
            delta_hstu_mha, length, None, delta_q, k, v, offs, attn_func=delta_func, kernel=setup.backend
        ),
        "delta, e4m3": functools.partial(
            delta_hstu_mha,
            length,
            None,
            q8,
            k8,
            v8,
            offs,
            attn_func=delta_func,
            kernel=setup.backend,
            fp8_scales=(qs, ks, vs),
        ),
        "full, same pairs": functools.partial(
            hstu_mha, length, None, q, k, v, offs, attn_func=same_pairs, kernel=setup.backend
        ),
        "full, onerank": functools.partial(hstu_mha, length, None, q, k, v, offs, attn_func=func, kernel=setup.backend),
    }
    counted = {
        name: int(masks.count_visible(f, offs).sum()) * heads for name, f in (("same", same_pairs), ("onerank", func))
    }
    pairs = {
        "delta": counted["same"],
        "delta, e4m3": counted["same"],
        "full, same pairs": counted["same"],
        "full, onerank": counted["onerank"],
    }
    return KernelCalls(calls, pairs)


def _kernel_case(setup: Setup, *, hist: int, cands: int, users: int) -> Iterator[KernelRow]:
    shape = dict(hist=hist, cands=cands, users=users, heads=setup.heads, head_dim=setup.dim // setup.heads)
    names = ("delta", "delta, e4m3", "full, same pairs", "full, onerank")
    rows = [KernelRow(kernel=name, **shape) for name in names]
    building, case = KernelRow(kernel="inputs", **shape), None
    with reported(building, setup.device):
        case = kernel_calls(setup, hist=hist, cands=cands, users=users)
    for row in rows:
        if case is None:
            row.status = f"{building.status} (building the inputs)"
        else:
            row.pairs = case.pairs[row.kernel]
            with reported(row, setup.device), torch.no_grad():
                row.ms, row.eager_ms = device_ms(case.calls[row.kernel], setup)
                row.tflops = 4 * row.pairs * row.head_dim / (row.ms * 1e9)
        yield row
