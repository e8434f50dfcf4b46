"""Launch plumbing and the torch.library custom ops (forward, backward, autograd, fake)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ..._errors import bad_value
from .args import FixedRule, Func, jagged
from .backward import hstu_backward_dkdv_kernel, hstu_backward_dq_kernel
from .config import tiles
from .debug import poisoning
from .forward import hstu_forward_kernel
from .limits import MAX_HEAD_DIM, MIN_HEAD_DIM, head_dim_supported, tile_dim
from .plan import _plan_kernel
from .rules import BIG, MODE_CAUSAL, MODE_FIXED, MODE_FUNC
from .tables import BlockTables

_NEVER_SPLIT = int(BIG)
"""A chunk longer than any key block's query range (in query blocks)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class Visibility:
    """How the kernels learn visibility: a func tensor, closed-form causal, or the closed-form fixed rule."""

    mode: int
    func: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    contextual: int = 0
    window: int = 0
    min_full: int = 0

    def nfunc(self) -> int:
        if self.mode == MODE_FUNC:
            return self.func.shape[1]
        return 1 if self.mode == MODE_CAUSAL else 5

    def per_head(self) -> bool:
        f = self.func
        return f is not None and f.shape[0] > 1 and f.stride(0) != 0

    def kernel_args(self, placeholder: torch.Tensor) -> dict:
        """Mask arguments shared by every kernel: ``func``, ``rule`` and their constexprs. ``placeholder``
        stands in for an absent func or num_targets (never read): no allocation per call."""
        f = self.func
        func = Func(placeholder, 0, 0, 0) if f is None else Func(f, f.stride(0) if self.per_head() else 0,
                                                                  f.stride(1), f.stride(2))
        nt = self.num_targets if self.num_targets is not None else placeholder
        nfunc = self.nfunc()
        return dict(func=func, rule=FixedRule(nt, self.contextual, self.window, self.min_full),
                    NFUNC=nfunc, MODE=self.mode, HAS_TARGETS=self.num_targets is not None,
                    INTERVALS_POW2=max(2, triton.next_power_of_2((nfunc + 1) // 2)))


def _new_like(x: torch.Tensor, *shape: int) -> torch.Tensor:
    out = torch.empty(*(shape or x.shape), dtype=x.dtype, device=x.device)
    return out.fill_(float("nan")) if poisoning() else out


def _last_dim_contiguous(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _attention_args(q, k, v, offs, vis: Visibility, alpha: float, interpreting: bool) -> dict:
    """Arguments of the three attention kernels: Q, K, V, the mask, the head dims, the sigmoid switch
    (tanh.approx on the GPU; the interpreter has no inline PTX)."""
    dqk, dv = q.shape[2], v.shape[2]
    return dict(Q=jagged(q), K=jagged(k), V=jagged(v), OFFS=offs, alpha=alpha, DIM_QK=dqk, DIM_V=dv,
                TILE_QK=tile_dim(dqk), TILE_V=tile_dim(dv), FAST_SIGMOID=not interpreting, **vis.kernel_args(offs))


def _query_major_args(vis: Visibility) -> dict:
    """Register-resident intervals (the query-major kernels) for funcs of up to four intervals."""
    return dict(INTERVALS_IN_REGISTERS=vis.nfunc() <= 7)


def forward(q, k, v, offs, vis: Visibility, alpha: float, out_scale: float,
            tables: BlockTables | None = None) -> torch.Tensor:
    q, k, v = _last_dim_contiguous(q, k, v)
    total, nheads, dqk = q.shape
    out = _new_like(q, total, nheads, v.shape[2])
    if total == 0:
        return out
    interpreting = _interpreting()
    tile = tiles(tile_dim(dqk), tile_dim(v.shape[2]), interpreting).forward
    tables = tables if tables is not None else BlockTables(offs, total)
    qtab, nqb = tables.table(tile.block_m)
    hstu_forward_kernel[(nqb, nheads)](
        **_attention_args(q, k, v, offs, vis, alpha, interpreting), **_query_major_args(vis), **tile.launch(),
        OUT=jagged(out), QTAB=qtab, n_flat=nqb, out_scale=out_scale,
    )
    return out


def backward(dout, q, k, v, offs, vis: Visibility, alpha: float, out_scale: float, max_seq_len: int,
             tables: BlockTables | None = None):
    dout, q, k, v = _last_dim_contiguous(dout, q, k, v)
    total, nheads, dqk = q.shape
    dq = _new_like(q)
    if total == 0:
        return dq, _new_like(k), _new_like(v)
    interpreting = _interpreting()
    _, tq, tkv = tiles(tile_dim(dqk), tile_dim(v.shape[2]), interpreting)
    args = _attention_args(q, k, v, offs, vis, alpha, interpreting)
    tables = tables if tables is not None else BlockTables(offs, total)
    qtab, nqb = tables.table(tq.block_m)
    hstu_backward_dq_kernel[(nqb, nheads)](
        **args, **_query_major_args(vis), **tq.launch(),
        DO=jagged(dout), DQ=jagged(dq), QTAB=qtab, n_flat=nqb, dq_scale=alpha * out_scale,
    )
    # Key-major pass: its query blocks (BLOCK_M) and key blocks (BLOCK_N) index the plan.
    ptab, npb = tables.table(tkv.block_m)
    ktab, nkb = tables.table(tkv.block_n)
    # Split a key block's query range when it is long: at most 8 chunks of at least `chunk` query blocks.
    # max_seq_len only sizes the split: the last chunk runs to the end of the range whatever its length,
    # and with one program per key block (n_split 1) no range is split, since only n_split > 1 zeroes
    # the outputs that the split path adds into.
    q_blocks_max = max(1, -(-max(max_seq_len, 1) // tkv.block_m))
    chunk = 2 if interpreting else max(32, -(-q_blocks_max // 8))
    n_split = max(1, -(-q_blocks_max // chunk))
    if n_split == 1:
        chunk = _NEVER_SPLIT
    if n_split > 1:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    else:
        dk, dv = _new_like(k), _new_like(v)
    per_head = vis.per_head()
    nplan = nheads if per_head else 1
    if vis.mode == MODE_CAUSAL:
        bounds = qlo = qhi = ktab  # unused: the causal ranges are closed-form
    else:
        bounds = torch.empty(nplan, npb, 4, args["INTERVALS_POW2"], dtype=torch.int32, device=q.device)
        qlo = torch.full((nplan, nkb), int(BIG), dtype=torch.int32, device=q.device)
        qhi = torch.zeros((nplan, nkb), dtype=torch.int32, device=q.device)
        _plan_kernel[(npb, nplan)](
            **vis.kernel_args(offs), OFFS=offs, QTAB=ptab, BOUNDS=bounds, QLO=qlo, QHI=qhi, n_qblocks=npb,
            n_kblocks=nkb, BLOCK_M=tkv.block_m, BLOCK_N=tkv.block_n, num_warps=4,
        )
    hstu_backward_dkdv_kernel[(nkb * n_split, nheads)](
        **args, **tkv.launch(),
        DO=jagged(dout), DK=jagged(dk), DV=jagged(dv), KTAB=ktab, BOUNDS=bounds, QLO=qlo, QHI=qhi,
        plan_head=1 if per_head else 0, n_qblocks=npb, n_kblocks=nkb, n_split=n_split, chunk=chunk,
        dk_scale=alpha * out_scale, dv_scale=out_scale,
    )
    return dq, dk, dv


@torch.library.custom_op("flexhstu::hstu_mha_fwd", mutates_args=())
def hstu_mha_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                 func: torch.Tensor | None, num_targets: torch.Tensor | None, mode: int,
                 contextual: int, window: int, min_full: int, alpha: float, out_scale: float,
                 max_seq_len: int) -> torch.Tensor:
    vis = Visibility(mode, func, num_targets, contextual, window, min_full)
    return forward(q, k, v, seq_offsets, vis, alpha, out_scale)


@hstu_mha_fwd.register_fake
def _(q, k, v, seq_offsets, func, num_targets, mode, contextual, window, min_full, alpha, out_scale, max_seq_len):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("flexhstu::hstu_mha_bwd", mutates_args=())
def hstu_mha_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                 func: torch.Tensor | None, num_targets: torch.Tensor | None, mode: int,
                 contextual: int, window: int, min_full: int, alpha: float, out_scale: float,
                 max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vis = Visibility(mode, func, num_targets, contextual, window, min_full)
    return backward(dout, q, k, v, seq_offsets, vis, alpha, out_scale, max_seq_len)


@hstu_mha_bwd.register_fake
def _(dout, q, k, v, seq_offsets, func, num_targets, mode, contextual, window, min_full, alpha, out_scale, max_seq_len):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, seq_offsets, func, num_targets, *rest = inputs
    ctx.save_for_backward(q, k, v, seq_offsets, func, num_targets)
    ctx.rest = rest


def _backward(ctx, dout):
    q, k, v, seq_offsets, func, num_targets = ctx.saved_tensors
    dq, dk, dv = hstu_mha_bwd(dout, q, k, v, seq_offsets, func, num_targets, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


hstu_mha_fwd.register_autograd(_backward, setup_context=_setup_context)


class _HstuAttention(torch.autograd.Function):
    """Eager path: the same forward/backward as the custom ops, without the op dispatch layer,
    and with the block tables of the forward reused by the backward."""

    @staticmethod
    def forward(ctx, q, k, v, offs, func, num_targets, mode, contextual, window, min_full, alpha, out_scale,
                max_seq_len):
        tables = BlockTables(offs, q.shape[0])
        vis = Visibility(mode, func, num_targets, contextual, window, min_full)
        out = forward(q, k, v, offs, vis, alpha, out_scale, tables)
        ctx.save_for_backward(q, k, v, offs, func, num_targets)
        ctx.rest = (vis, alpha, out_scale, max_seq_len)
        ctx.tables = tables
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offs, func, num_targets = ctx.saved_tensors
        vis, alpha, out_scale, max_seq_len = ctx.rest
        vis = Visibility(vis.mode, func, num_targets, vis.contextual, vis.window, vis.min_full)
        dq, dk, dv = backward(dout, q, k, v, offs, vis, alpha, out_scale, max_seq_len, ctx.tables)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def triton_hstu_mha(q, k, v, seq_offsets, *, func=None, num_targets=None, causal_closed_form=False,
                    contextual: int = 0, window: int = 0, min_full: int = 0,
                    alpha: float, out_scale: float, max_seq_len: int) -> torch.Tensor:
    """Dispatch to the custom op. ``func`` given: the func decides; else causal or the fixed rule in closed form.

    q, k: ``(total, H, Dqk)``, v: ``(total, H, Dv)``, any strides (a non-unit last stride costs a copy);
    seq_offsets ``(B + 1,)`` and num_targets ``(B,)``: int32 or int64, any stride. Returns ``(total, H, Dv)``.

    ``max_seq_len`` is only a tuning hint (it sizes the split of long key-major ranges): any value,
    0 or smaller than the longest sequence included, gives the same result.
    """
    for name, d in (("q.shape[2] (Dqk)", q.shape[2]), ("v.shape[2] (Dv)", v.shape[2])):
        if not head_dim_supported(d):
            raise bad_value(name, f"a head dim from {MIN_HEAD_DIM} to {MAX_HEAD_DIM} for the Triton kernels", d)
    # The kernels read offsets and num_targets as plain int64 / int arrays (no strides): made so here, once.
    offs = seq_offsets.to(torch.int64).contiguous()
    if num_targets is not None:
        num_targets = num_targets.contiguous()
    if func is not None:
        mode = MODE_FUNC
    elif causal_closed_form:
        mode = MODE_CAUSAL
    else:
        mode = MODE_FIXED
    args = (q, k, v, offs, func, num_targets, int(mode), contextual, window, min_full, alpha, out_scale, max_seq_len)
    if torch.compiler.is_compiling():
        return hstu_mha_fwd(*args)
    return _HstuAttention.apply(*args)
