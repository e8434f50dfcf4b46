"""Flat block tables: every block of every sequence gets one slot, found without a prefix sum.

``_block_table_kernel`` writes, per flat block, the sequence that owns it;
``locate_block`` turns a program id back into (sequence, block within it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fast_launch import Launcher


@triton.jit
def first_block(OFFS, seq, BLOCK: tl.constexpr):
    """Flat index of sequence ``seq``'s first block: ``offs[seq] // BLOCK + seq``.

    Consecutive sequences are at least ``cdiv(L, BLOCK)`` apart (at most one
    spare slot each), so the flat range ``[0, total // BLOCK + B)`` holds every
    block of every sequence with no prefix sum.
    """
    return (tl.load(OFFS + seq) // BLOCK + seq).to(tl.int32)


@triton.jit
def locate_block(TAB, OFFS, flat, BLOCK: tl.constexpr):
    """Flat block index -> (sequence, block within it, the sequence's first jagged row (int64), its length).

    The block may lie past the sequence's end (a spare slot): callers test ``local * BLOCK < L``.
    """
    seq = tl.load(TAB + flat)
    local = flat - first_block(OFFS, seq, BLOCK)
    seq_start = tl.load(OFFS + seq).to(tl.int64)
    length = (tl.load(OFFS + seq + 1) - seq_start).to(tl.int32)
    return seq, local, seq_start, length


@triton.jit
def _block_table_kernel(OFFS, TAB, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """One program per sequence: write its id over its flat block slots."""
    b = tl.program_id(0)
    lo = first_block(OFFS, b, BLOCK)
    hi = first_block(OFFS, b + 1, BLOCK)
    for c0 in range(lo, hi, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        tl.store(TAB + idx, b + tl.zeros_like(idx), mask=idx < hi)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _safe_offsets_kernel(OFFS, OUT, n, total, CHUNK: tl.constexpr):
    """One program: ``OUT`` = ``OFFS`` clamped to ``[0, total]``, made non-decreasing (running max), with the
    first entry 0 and the last ``total`` (``n >= 2``)."""
    run = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, n, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        x = tl.load(OFFS + idx, mask=idx < n, other=0).to(tl.int64)
        x = tl.minimum(tl.maximum(x, 0), total)
        x = tl.where(idx == 0, 0, tl.where(idx == n - 1, total, x))
        x = tl.maximum(tl.associative_scan(x, 0, _max_combine), run)
        tl.store(OUT + idx, x, mask=idx < n)
        run = tl.max(x, axis=0)


_SAFE_OFFSETS, _BLOCK_TABLE = Launcher(_safe_offsets_kernel), Launcher(_block_table_kernel)


def safe_offsets(offs: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``(B + 1,)`` offsets that every kernel can follow without leaving its buffers, whatever ``offs``
    (int64, contiguous, ``B >= 1``) holds: equal to it when it is valid (0 first, ``total`` last,
    non-decreasing); otherwise clamped into ``[0, total]``, made non-decreasing, first 0 and last ``total``.
    The values are never read on the host (no sync): on the CPU ``hstu_mha`` refuses bad offsets before, on
    CUDA this keeps bad ones from reading or writing out of bounds (one launch)."""
    n = offs.numel()
    out = torch.empty_like(offs)
    _SAFE_OFFSETS.launch((1,), OFFS=offs, OUT=out, n=n, total=total, CHUNK=min(1024, triton.next_power_of_2(n)))
    return out


def block_table(offs: torch.Tensor, total: int, block: int) -> tuple[torch.Tensor, int]:
    """(sequence of each flat block, number of flat blocks) for one block size.

    Sequence ``b`` owns flat blocks from ``offs[b] // block + b``; the count
    ``total // block + B`` needs no device read. One launch, no prefix sum.
    """
    nseq = offs.numel() - 1
    bound = total // block + nseq
    tab = torch.empty(bound, dtype=torch.int32, device=offs.device)
    _BLOCK_TABLE.launch((nseq,), OFFS=offs, TAB=tab, BLOCK=block, CHUNK=256)
    return tab, bound


class BlockTables:
    """Block tables by block size, built on first use and shared by the forward and the backward of one call."""

    def __init__(self, offs: torch.Tensor, total: int):
        self._offs, self._total = offs, total
        self._by_block: dict[int, tuple[torch.Tensor, int]] = {}

    def table(self, block: int) -> tuple[torch.Tensor, int]:
        """(sequence of each flat block ``(n,)`` int32, ``n``) for blocks of ``block`` rows."""
        if block not in self._by_block:
            self._by_block[block] = block_table(self._offs, self._total, block)
        return self._by_block[block]
