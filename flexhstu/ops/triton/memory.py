"""Tile loads and stores of jagged ``(total, H, D)`` tensors (``Jagged``: pointer and strides).

A tile spans ``D_TILE`` columns, the head dim rounded up to a power of two (at least 16, what
``tl.dot`` needs); columns past ``D`` read 0 and are not written, so they add nothing to any dot
product. When ``D == D_TILE`` (every power-of-two dim) no column mask is generated.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_mask(ok, D: tl.constexpr, D_TILE: tl.constexpr):
    """``(len(ok), 1)`` row mask, or ``(len(ok), D_TILE)`` row-and-column mask when the tile is padded."""
    if D == D_TILE:
        return ok[:, None]
    else:
        return ok[:, None] & (tl.arange(0, D_TILE) < D)[None, :]


@triton.jit
def tile_ptrs(x, rows_g, h, D_TILE: tl.constexpr):
    """``(len(rows_g), D_TILE)`` pointers to head ``h`` of jagged rows ``rows_g``."""
    return x.ptr + rows_g[:, None] * x.stride_t + h * x.stride_h + tl.arange(0, D_TILE)[None, :]


@triton.jit
def load_rows(x, rows_g, ok, h, D: tl.constexpr, D_TILE: tl.constexpr):
    """``(len(rows_g), D_TILE)`` tile of head ``h`` at jagged rows ``rows_g``; rows where ``ok`` is
    False and columns past ``D`` read 0."""
    return tl.load(tile_ptrs(x, rows_g, h, D_TILE), mask=tile_mask(ok, D, D_TILE), other=0.0)


@triton.jit
def store_rows(x, rows_g, ok, h, tile, D: tl.constexpr, D_TILE: tl.constexpr):
    """Store ``tile`` (cast to ``x``'s dtype) at jagged rows ``rows_g`` of head ``h`` where ``ok``."""
    tl.store(tile_ptrs(x, rows_g, h, D_TILE), tile.to(x.ptr.dtype.element_ty), mask=tile_mask(ok, D, D_TILE))
