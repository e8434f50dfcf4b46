"""Tiles (block sizes, warps, stages) of the three attention kernels: defaults and explicit overrides.

The defaults were measured on an H200 (``benchmarks/sweep.py``). ``tile_override`` replaces
them inside a ``with`` block, for the sweep and the benchmarks; nothing is read from the
environment.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)


class Tiles(NamedTuple):
    forward: Tile
    dq: Tile
    dkdv: Tile


_OVERRIDE: ContextVar[dict | None] = ContextVar("flexhstu_triton_tiles", default=None)


def default_tiles(dim_qk: int, dim_v: int, interpreting: bool, sparse: bool = False, bias: bool = False) -> Tiles:
    """Tiles for head dims ``dim_qk``, ``dim_v`` (the padded, power-of-two dims of the kernels' tiles).

    ``sparse``: the mask shows each query block few key blocks (a window, SLA): smaller tiles of four warps,
    two programs per multiprocessor, waste fewer masked pairs and hide the latency of short walks (H200, D 128,
    ``benchmarks/sweep.py``: window 256 forward 246 -> 187 us, dQ 296 -> 238, dK/dV 510 -> 393 on B8 S8192;
    on causal the large forward and dQ tiles stay ahead). The interpreter gets small, unequal blocks so the CPU
    tests cross many blocks, with another shape for sparse masks so both tile families are tested.

    ``bias``: the call adds a relative attention bias. Its dK/dV kernel (the bias on every tile and the tables'
    gradients on top of k, v and both accumulators) spills at 64 query rows a tile; 32 rows and two stages
    measured 14.7 -> 10.3 ms forward+backward on causal B4 S8192 H4 D128 and 4.49 -> 3.42 ms on SLA 256/32
    (H200, ``benchmarks/bench_bias.py --tiles``; 16 rows and 8 warps were slower, and 8 warps do not compile
    for every mask).
    """
    if interpreting:
        if sparse:
            return Tiles(Tile(16, 16, 4, 1), Tile(16, 16, 4, 1), Tile(16, 32, 4, 1))
        return Tiles(Tile(32, 16, 4, 1), Tile(16, 32, 4, 1), Tile(16, 32, 4, 1))
    d = max(dim_qk, dim_v)
    if 64 < d <= 128 and bias:
        chosen = default_tiles(dim_qk, dim_v, interpreting, sparse)
        return chosen._replace(dkdv=Tile(32, 64, 4, 2))
    if d <= 128 and sparse:
        return Tiles(Tile(64, 64, 4, 3), Tile(64, 64, 4, 2), Tile(32, 64, 4, 3))
    if d <= 64:
        return Tiles(Tile(128, 64, 4, 3), Tile(128, 64, 4, 3), Tile(64, 128, 4, 3))
    if d <= 128:
        return Tiles(Tile(128, 64, 8, 3), Tile(128, 64, 8, 3), Tile(64, 64, 4, 2))
    return Tiles(Tile(64, 64, 4, 2), Tile(64, 32, 4, 2), Tile(32, 64, 4, 2))


@contextmanager
def tile_override(*, forward: Tile | None = None, dq: Tile | None = None, dkdv: Tile | None = None) -> Iterator[None]:
    """Within the block, the given kernels use these tiles whatever the head dims (the others keep theirs)."""
    given = {name: t for name, t in (("forward", forward), ("dq", dq), ("dkdv", dkdv)) if t is not None}
    token = _OVERRIDE.set({**(_OVERRIDE.get() or {}), **given})
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def tiles(dim_qk: int, dim_v: int, interpreting: bool, sparse: bool = False, bias: bool = False) -> Tiles:
    """The tiles a call uses: the defaults, with any ``tile_override`` in force."""
    chosen = default_tiles(dim_qk, dim_v, interpreting, sparse, bias)
    override = _OVERRIDE.get()
    return chosen._replace(**override) if override else chosen
