"""Tile loads and stores of jagged ``(total, H, D)`` tensors (``Jagged``: pointer and strides)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rows(x, rows_g, ok, h, D: tl.constexpr):
    """``(len(rows_g), D)`` tile of head ``h`` at jagged rows ``rows_g``; rows where ``ok`` is False read 0."""
    return tl.load(x.ptr + rows_g[:, None] * x.stride_t + h * x.stride_h + tl.arange(0, D)[None, :],
                   mask=ok[:, None], other=0.0)


@triton.jit
def store_rows(x, rows_g, ok, h, tile, D: tl.constexpr):
    """Store ``tile`` (cast to ``x``'s dtype) at jagged rows ``rows_g`` of head ``h`` where ``ok``."""
    tl.store(x.ptr + rows_g[:, None] * x.stride_t + h * x.stride_h + tl.arange(0, D)[None, :],
             tile.to(x.ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def add_rows(x, rows_g, ok, h, tile, D: tl.constexpr):
    """Atomically add ``tile`` (cast to ``x``'s dtype) at jagged rows ``rows_g`` of head ``h`` where ``ok``."""
    tl.atomic_add(x.ptr + rows_g[:, None] * x.stride_t + h * x.stride_h + tl.arange(0, D)[None, :],
                  tile.to(x.ptr.dtype.element_ty), mask=ok[:, None], sem="relaxed")
