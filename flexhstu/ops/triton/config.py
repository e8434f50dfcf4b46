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
from functools import lru_cache
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


@lru_cache(maxsize=64)
def default_tiles(dim_qk: int, dim_v: int, interpreting: bool, sparse: bool = False, bias: bool = False) -> Tiles:
    """Tiles for head dims ``dim_qk``, ``dim_v`` (the padded, power-of-two dims of the kernels' tiles).

    ``sparse``: the mask shows each query block few key blocks (a window, SLA): smaller tiles of four warps,
    two programs per multiprocessor, waste fewer masked pairs and hide the latency of short walks; on causal
    masks the large forward and dQ tiles are faster. H200, D 128, window 256 on B8 S8192 (``benchmarks/sweep.py``),
    the sparse tiles against the causal ones: forward 187 us against 246, dQ 238 against 296, dK/dV 393
    against 510. The interpreter gets small, unequal blocks so the CPU tests cross many blocks, with another
    shape for sparse masks so both tile families are tested.

    ``bias``: the call adds a relative attention bias (from its tables, or a dense ``rab``: sm_90 spills of the
    rab kernels at D 128 fall from 704-936 to 184-312 bytes in the dK/dV kernel and to 0 at D 64 with these
    tiles, ``benchmarks/compile_check.py``), whose per-tile work and gradients need registers the plain tiles
    do not leave: the dK/dV kernel takes 32 query rows and two stages, and at D <= 64 the
    forward and dQ kernels also take 64 x 64 tiles of 4 warps. H200, forward+backward B4 S8192 H4
    (``benchmarks/bench_bias.py --tiles``), these tiles against the plain ones: D 128 causal 10.3 ms against
    14.7, SLA 256/32 3.42 against 4.49; D 64 causal 7.4 against 24.0, SLA 2.5 against 9.5; D 32 causal 6.7
    against 15.1, SLA 2.3 against 5.6. dK/dV tiles of 16 rows and of 8 warps are slower (8 warps do not
    compile for every mask), and so are smaller forward and dQ tiles at D 128.
    """
    if interpreting:
        if sparse:
            return Tiles(Tile(16, 16, 4, 1), Tile(16, 16, 4, 1), Tile(16, 32, 4, 1))
        return Tiles(Tile(32, 16, 4, 1), Tile(16, 32, 4, 1), Tile(16, 32, 4, 1))
    d = max(dim_qk, dim_v)
    if d <= 64 and bias:
        return Tiles(Tile(64, 64, 4, 3), Tile(64, 64, 4, 3), Tile(32, 64, 4, 2))
    if d <= 128 and bias:
        return default_tiles(dim_qk, dim_v, interpreting, sparse)._replace(dkdv=Tile(32, 64, 4, 2))
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
