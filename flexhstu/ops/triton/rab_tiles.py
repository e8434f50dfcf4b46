"""A dense attention bias (``rab``, the fbgemm CUTLASS convention) in the Triton kernels: one tile load per block.

``rab`` is ``(B, N, N)`` or ``(B, 1 or H, N, N)`` with ``N = max_seq_len``; entry ``[b, h, i, j]`` is added to
the score of local query ``i`` and key ``j`` of sequence ``b`` (docs/design.md, section 4). The kernels
read it as a ``Rab``: its tensor and strides, the head stride 0 when the heads share it. Entries of a
pair outside its sequence (``i`` or ``j`` at or past ``L``) or past ``N`` are never read: the padding of
``rab`` may hold anything, NaN included, and a sequence longer than ``N`` (which the host checks where it
can read the offsets) gets no bias past ``N`` instead of a read out of bounds.

The gradient is the masked ``dS`` of each pair, which the key-major dK/dV kernel holds per tile: stored into
a zeroed float32 buffer of ``rab``'s shape (each pair belongs to one tile of one program), or added
atomically when the heads share ``rab`` (then the order of the heads' sums, hence their last bits, varies from
run to run). Offsets are int64 throughout: a ``(B, H, N, N)`` tensor may hold more than 2^31 elements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Rab(NamedTuple):
    """``ptr``: a ``(B, Hr, N, N)`` tensor (its ``[b, h, i, j]`` at ``b stride_b + h stride_h + i stride_i + j
    stride_j``; ``stride_h`` 0 when one row serves every head); ``n``: ``N``."""

    ptr: torch.Tensor
    stride_b: int
    stride_h: int
    stride_i: int
    stride_j: int
    n: int


def rab_args(rab: torch.Tensor) -> Rab:
    """The kernels' view of a ``(B, N, N)`` or ``(B, Hr, N, N)`` tensor (``Hr`` 1 or H)."""
    r = rab if rab.dim() == 4 else rab.unsqueeze(1)
    return Rab(r, r.stride(0), r.stride(1) if r.shape[1] > 1 else 0, r.stride(2), r.stride(3), r.shape[-1])


@triton.jit
def rab_base(rab, seq, h):
    """Pointer to ``rab[seq, h, 0, 0]``."""
    return rab.ptr + seq.to(tl.int64) * rab.stride_b + h.to(tl.int64) * rab.stride_h


@triton.jit
def _tile(rab, base, L, rows, cols, TRANS: tl.constexpr):
    """Pointers and in-range mask of a ``(rows, cols)`` tile (``(cols, rows)`` when TRANS)."""
    lim = tl.minimum(L, rab.n)
    if TRANS:
        ok = (cols[:, None] < lim) & (rows[None, :] < lim)
        ptrs = base + rows[None, :].to(tl.int64) * rab.stride_i + cols[:, None].to(tl.int64) * rab.stride_j
    else:
        ok = (rows[:, None] < lim) & (cols[None, :] < lim)
        ptrs = base + rows[:, None].to(tl.int64) * rab.stride_i + cols[None, :].to(tl.int64) * rab.stride_j
    return ptrs, ok


@triton.jit
def add_rab(s, rab, base, L, rows, cols, TRANS: tl.constexpr):
    """``s`` plus the float32 ``rab`` entries of its tile (0 outside the sequence and past ``N``)."""
    ptrs, ok = _tile(rab, base, L, rows, cols, TRANS)
    return s + tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def store_rab_grad(drab, base, L, rows, cols, g, TRANS: tl.constexpr, SHARED: tl.constexpr):
    """Write the tile's gradient ``g`` (float32, masked) into ``drab`` (float32, ``rab``'s strides), adding
    atomically when SHARED (the heads' programs meet on the same entries)."""
    ptrs, ok = _tile(drab, base, L, rows, cols, TRANS)
    if SHARED:
        tl.atomic_add(ptrs, g, mask=ok, sem="relaxed")
    else:
        tl.store(ptrs, g, mask=ok)
