"""What the Triton kernels support, in plain Python (no triton import), for capability checks."""

from __future__ import annotations

MIN_HEAD_DIM = 1
MAX_HEAD_DIM = 256
"""Head dims (Dqk and Dv, independently) the kernels run: any integer in ``[MIN_HEAD_DIM, MAX_HEAD_DIM]``.
Dims that are not powers of two (or below 16) run in the tile of the next power of two (at least 16)."""


def head_dim_supported(d: int) -> bool:
    """True when the Triton kernels run head dim ``d`` (as Dqk or as Dv)."""
    return MIN_HEAD_DIM <= d <= MAX_HEAD_DIM


def tile_dim(d: int) -> int:
    """The tile width for head dim ``d``: the next power of two, at least 16."""
    return max(16, 1 << (d - 1).bit_length())
