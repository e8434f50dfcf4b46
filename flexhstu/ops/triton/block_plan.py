"""The per-batch block plan of the Triton kernels: block tables and the key-major plan, built once.

A plan depends on the mask and the offsets only (docs/design.md, section 8), so every layer of a
model, forward and backward, can share it. The parts that depend on tile sizes (which follow the
head dims) are built on first use for each tile and cached in the object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from .args import Func, RuleArgs
from .block_tables import BlockTables, safe_offsets
from .config import Tile
from .hulls import _plan_kernel, _split_list_kernel
from .row_intervals import BIG, MODE_CAUSAL, MODE_FUNC

_FUNC, _CAUSAL = int(MODE_FUNC), int(MODE_CAUSAL)


@dataclass
class Visibility:
    """How the kernels learn visibility: a func tensor, closed-form causal, or the closed-form fixed rule.

    ``sparse``: whether query blocks see few key blocks, which picks the kernels' tiles (``config.default_tiles``).
    The fields are set once; the kernels' arguments made from them are kept (``kernel_args``, ``cached_args``),
    since an eager call's host time is what small batches wait on.
    """

    mode: int
    func: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    contextual: int = 0
    window: int = 0
    min_full: int = 0
    sparse: bool = False
    _args: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def nfunc(self) -> int:
        if self.mode == _FUNC:
            return self.func.shape[1]
        return 1 if self.mode == _CAUSAL else 5

    def per_head(self) -> bool:
        f = self.func
        return f is not None and f.shape[0] > 1 and f.stride(0) != 0

    def intervals_pow2(self) -> int:
        return max(2, triton.next_power_of_2((self.nfunc() + 1) // 2))

    def kernel_args(self, placeholder: torch.Tensor) -> dict:
        """Mask arguments shared by every kernel: ``func``, ``rule`` and their constexprs. ``placeholder``
        stands in for an absent func or num_targets (never read): no allocation per call. Kept for the last
        placeholder, never to be changed (``cached_args``)."""
        return self.cached_args(placeholder, (), lambda: self._kernel_args(placeholder))

    def _kernel_args(self, placeholder: torch.Tensor) -> dict:
        f = self.func
        func = Func(placeholder, 0, 0, 0) if f is None else Func(f, f.stride(0) if self.per_head() else 0,
                                                                  f.stride(1), f.stride(2))
        nt = self.num_targets if self.num_targets is not None else placeholder
        return dict(func=func, rule=RuleArgs(nt, self.contextual, self.window, self.min_full),
                    NFUNC=self.nfunc(), MODE=self.mode, HAS_TARGETS=self.num_targets is not None,
                    INTERVALS_POW2=self.intervals_pow2())

    def cached_args(self, placeholder: torch.Tensor, key: tuple, build) -> dict:
        """``build()``, made once for ``placeholder`` (the offsets the kernels follow) and ``key`` (what else the
        arguments depend on) and kept while the placeholder stays the same tensor object. A new placeholder swaps
        in a new store in one assignment, so a call never files its arguments under another call's placeholder.

        The dict kept is the one returned, never to be changed: callers spread it (``**``) or copy it. It is a
        plain dict, not a read-only view, since spreading a ``MappingProxyType`` of a launch's twenty-odd
        arguments costs twice what a dict's does (1.1 us more per launch on the CPU emulation)."""
        kept = self._args
        if kept is None or kept[0] is not placeholder:
            kept = (placeholder, {})
            self._args = kept
        store = kept[1]
        args = store.get(key)
        if args is None:
            args = store[key] = build()
        return args


@dataclass(frozen=True, eq=False)
class SplitList:
    """The dK/dV kernel's extra work items for one ``chunk`` (``hulls._split_list_kernel``): per plan row, the
    pieces ``1 ..`` of every key block whose query range is longer than ``chunk`` query blocks, as int32
    ``(Hplan, cap)`` key blocks ``kb`` and query-block ranges ``[lo, hi)``, and their count ``n (Hplan,)``.
    Built on the device, read only by the kernel: no host sync."""

    chunk: int
    kb: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    n: torch.Tensor
    cap: int


class KeyMajorPlan:
    """What the dK/dV kernel reads: per query block its hull/core vectors ``bounds (Hplan, n_qblocks, 4,
    INTERVALS_POW2)``, per key block the first (``qlo``) and past-the-last (``qhi``) query block that sees
    it ``(Hplan, n_kblocks)``; ``Hplan`` is H for a per-head func, else 1. Under MODE_CAUSAL the ranges are
    closed-form and the three are placeholders."""

    def __init__(self, offs: torch.Tensor, vis: Visibility, tables: BlockTables, tile: Tile, nplan: int):
        ptab, npb = tables.table(tile.block_m)
        ktab, nkb = tables.table(tile.block_n)
        self.ktab, self.n_qblocks, self.n_kblocks = ktab, npb, nkb
        self._offs, self._tile, self._nplan, self._causal = offs, tile, nplan, vis.mode == MODE_CAUSAL
        self._splits: dict[tuple[int, int], SplitList] = {}
        if vis.mode == MODE_CAUSAL:
            self.bounds = self.qlo = self.qhi = ktab
            return
        dev = offs.device
        self.bounds = torch.empty(nplan, npb, 4, vis.intervals_pow2(), dtype=torch.int32, device=dev)
        self.qlo = torch.full((nplan, nkb), int(BIG), dtype=torch.int32, device=dev)
        self.qhi = torch.zeros((nplan, nkb), dtype=torch.int32, device=dev)
        _plan_kernel[(npb, nplan)](
            **vis.kernel_args(offs), OFFS=offs, QTAB=ptab, BOUNDS=self.bounds, QLO=self.qlo, QHI=self.qhi,
            n_qblocks=npb, n_kblocks=nkb, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=4,
        )

    def split_list(self, chunk: int, max_split: int) -> SplitList:
        """The extra work items of key blocks seen by more than ``chunk`` query blocks, each cut into at most
        ``max_split`` (a power of two) pieces (built on first use for each pair, one launch)."""
        key = (chunk, max_split)
        if key not in self._splits:
            dev = self._offs.device
            cap = max(1, self.n_kblocks * (max_split - 1))
            kb, lo, hi = (torch.empty(self._nplan, cap, dtype=torch.int32, device=dev) for _ in range(3))
            n = torch.zeros(self._nplan, dtype=torch.int32, device=dev)
            per_program = 16  # key blocks per program: the programs reserve their slots in parallel
            _split_list_kernel[(triton.cdiv(self.n_kblocks, per_program), self._nplan)](
                self._offs, self.ktab, self.qlo, self.qhi, kb, lo, hi, n, self.n_kblocks, chunk, cap,
                CAUSAL=self._causal, MAX_SPLIT=max_split, BLOCK_M=self._tile.block_m, BLOCK_N=self._tile.block_n,
                CHUNK=per_program, num_warps=4)
            self._splits[key] = SplitList(chunk, kb, lo, hi, n, cap)
        return self._splits[key]


class BlockPlan:
    """Block tables and key-major plans of one batch and one mask, built on the GPU with no host sync.

    ``offs``: int64 contiguous ``(B + 1,)``; ``total``: the number of jagged rows.
    """

    def __init__(self, offs: torch.Tensor, total: int, vis: Visibility):
        self.raw_offs, self.total, self.vis = offs, total, vis
        self._offs: torch.Tensor | None = None
        self._tables: BlockTables | None = None
        self._key_major: dict[Tile, KeyMajorPlan] = {}

    @property
    def offs(self) -> torch.Tensor:
        """The offsets every kernel follows, never the caller's: bad values (unchecked on CUDA) cannot send a
        kernel out of its buffers (``tables.safe_offsets``). Made on first use (one launch), so that building a
        plan launches nothing (torch.compile traces the plan-free path, whose op builds its own)."""
        if self._offs is None:
            raw = self.raw_offs
            self._offs = safe_offsets(raw, self.total) if raw.numel() > 1 and self.total > 0 else raw
        return self._offs

    @property
    def tables(self) -> BlockTables:
        if self._tables is None:
            self._tables = BlockTables(self.offs, self.total)
        return self._tables

    def key_major(self, tile: Tile) -> KeyMajorPlan:
        """The key-major plan for the dK/dV kernel's ``tile`` (built on first use)."""
        if tile not in self._key_major:
            nplan = self.vis.func.shape[0] if self.vis.per_head() else 1
            self._key_major[tile] = KeyMajorPlan(self.offs, self.vis, self.tables, tile, nplan)
        return self._key_major[tile]
