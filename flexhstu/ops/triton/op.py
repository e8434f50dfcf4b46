"""Launch plumbing and the torch.library custom ops (forward, backward, autograd, fake)."""

from __future__ import annotations

import os

import torch

from ..._errors import bad_value
from ..bias import RelativeBias
from . import bias_tables
from .args import jagged
from .backward import hstu_backward_dkdv_kernel, hstu_backward_dq_kernel
from .block_plan import BlockPlan, Visibility
from .config import Tiles, tiles
from .debug import poisoning
from .forward import hstu_forward_kernel
from .limits import MAX_HEAD_DIM, MIN_HEAD_DIM, head_dim_supported, tile_dim
from .row_intervals import BIG, MODE_CAUSAL, MODE_FIXED, MODE_FUNC

_NEVER_SPLIT = int(BIG)
"""A chunk longer than any key block's query range (in query blocks)."""
MAX_SPLIT = 16
"""Pieces a long key-major range is cut into at most (a power of two). Each piece's partial dK, dV is added
atomically in the outputs' dtype, so more pieces mean more roundings of bf16 sums; 16 pieces of 256 query
blocks of 32 rows cover a 131,072-row SLA prefix column with no piece longer than the average walk."""
_SMS: dict[torch.device, int] = {}


def _workers(device: torch.device) -> int:
    """Split-list workers per head: two per multiprocessor, enough to start every piece at once on the usual
    batches (an idle worker reads one count and exits)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
            else 4
    return 2 * _SMS[device]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _new_like(x: torch.Tensor, *shape: int) -> torch.Tensor:
    out = torch.empty(*(shape or x.shape), dtype=x.dtype, device=x.device)
    return out.fill_(float("nan")) if poisoning() else out


def _last_dim_contiguous(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: float32 inputs honour ``torch.backends.cuda.matmul.allow_tf32``
    (IEEE fp32 products when it is False); half types multiply exactly in any case ("tf32", the default)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _attention_args(q, k, v, offs, vis: Visibility, alpha: float, interpreting: bool) -> dict:
    """Arguments of the three attention kernels: Q, K, V, the mask, the head dims, the sigmoid switch
    (tanh.approx on the GPU; the interpreter has no inline PTX), the dot precision, and FLOOR_SCORES: with
    ``|alpha| > 1`` a finite ``q.k`` can overflow to -inf in ``alpha q.k``, so the scores are floored
    (``silu.finite_below``); with ``|alpha| <= 1`` it cannot, and the kernels skip that step."""
    dqk, dv = q.shape[2], v.shape[2]
    return dict(Q=jagged(q), K=jagged(k), V=jagged(v), OFFS=offs, alpha=alpha, DIM_QK=dqk, DIM_V=dv,
                TILE_QK=tile_dim(dqk), TILE_V=tile_dim(dv), FAST_SIGMOID=not interpreting,
                FLOOR_SCORES=abs(alpha) > 1.0, DOT_PRECISION=dot_precision(q.dtype), **vis.kernel_args(offs))


def _scale_args(attn_scale: torch.Tensor | None, offs: torch.Tensor) -> dict:
    """The per-row factor of A (attn_scale, float32 ``(total,)``) when given; ``offs`` is a never-read stand-in."""
    return dict(ATTN_SCALE=offs if attn_scale is None else attn_scale, HAS_ATTN_SCALE=attn_scale is not None)


def _bias_args(bias: bias_tables.Prepared | None) -> dict:
    """The relative bias's kernel arguments (none without one: the kernels compile as before)."""
    return {} if bias is None else dict(BIAS=bias.args, HAS_BIAS=True)


def bias_passes(bias: bias_tables.Prepared | None) -> tuple[dict, ...]:
    """The dK/dV kernel's launches and their bias arguments: one without a bias; with one, a launch for the
    sequences without a wide chunk and one (WIDE_PASS, the int64 path compiled in) for those with one
    (``Bias.seq_wide``, on the device: which sequences are wide is not read here, so both always run, and a
    program of the other kind returns at once). The query-major kernels (forward, dQ) keep both copies of
    their walk in one launch: split in two launches they ran 4% slower forward on an H100, while the dK/dV
    kernel ran faster."""
    if bias is None:
        return ({},)
    return tuple(dict(BIAS=bias.args, HAS_BIAS=True, WIDE_PASS=wide) for wide in (False, True))


def call_tiles(q: torch.Tensor, v: torch.Tensor, vis: Visibility, bias: bool = False) -> Tiles:
    """The tiles of one call (defaults for its head dims, the mask's sparsity and whether a relative bias is
    added, or a ``tile_override`` in force), read once when the call starts and carried to its backward, which
    autograd may run on another thread."""
    return tiles(tile_dim(q.shape[2]), tile_dim(v.shape[2]), _interpreting(), vis.sparse, bias)


def forward(q, k, v, offs, vis: Visibility, alpha: float, out_scale: float,
            attn_scale: torch.Tensor | None = None, plan: BlockPlan | None = None,
            tile_set: Tiles | None = None, bias: bias_tables.Prepared | None = None) -> torch.Tensor:
    """``out_scale`` scales every row; with ``attn_scale`` (float32 ``(total,)``) row ``t`` is scaled by
    ``attn_scale[t]`` instead. ``tile_set``: the call's tiles (``call_tiles`` when None). ``bias``: a
    relative bias (``bias.prepare``) added to the scores."""
    q, k, v = _last_dim_contiguous(q, k, v)
    total, nheads, _ = q.shape
    out = _new_like(q, total, nheads, v.shape[2])
    if total == 0:
        return out
    if offs.numel() == 1:  # no sequence (unchecked on CUDA): no row sees anything
        return out.zero_()
    interpreting = _interpreting()
    tile = (tile_set or call_tiles(q, v, vis, bias is not None)).forward
    plan = plan if plan is not None else BlockPlan(offs, total, vis)
    offs = plan.offs  # safe offsets (BlockPlan.offs): the kernels never follow the caller's
    qtab, nqb = plan.tables.table(tile.block_m)
    hstu_forward_kernel[(nqb, nheads)](
        **_attention_args(q, k, v, offs, vis, alpha, interpreting), **tile.launch(),
        **_scale_args(attn_scale, offs), **_bias_args(bias), OUT=jagged(out), QTAB=qtab, n_flat=nqb,
        out_scale=1.0 if attn_scale is not None else out_scale,
    )
    return out


def backward(dout, q, k, v, offs, vis: Visibility, alpha: float, out_scale: float, max_seq_len: int,
             attn_scale: torch.Tensor | None = None, plan: BlockPlan | None = None, tile_set: Tiles | None = None,
             bias: bias_tables.Prepared | None = None):
    """dq, dk, dv; with ``bias`` the scores include it, and when its gradient buffers are allocated
    (``bias.prepare(with_grads=True)``) the dK/dV kernel adds the tables' gradients into them."""
    dout, q, k, v = _last_dim_contiguous(dout, q, k, v)
    total, nheads, _ = q.shape
    dq = _new_like(q)
    if total == 0:
        return dq, _new_like(k), _new_like(v)
    if offs.numel() == 1:  # no sequence (unchecked on CUDA): no gradient
        return dq.zero_(), torch.zeros_like(k), torch.zeros_like(v)
    interpreting = _interpreting()
    _, tq, tkv = tile_set or call_tiles(q, v, vis, bias is not None)
    plan = plan if plan is not None else BlockPlan(offs, total, vis)
    offs = plan.offs  # safe offsets (BlockPlan.offs): the kernels never follow the caller's
    args = _attention_args(q, k, v, offs, vis, alpha, interpreting)
    args.update(_scale_args(attn_scale, offs))
    scale = 1.0 if attn_scale is not None else out_scale  # attn_scale replaces out_scale, row by row
    qtab, nqb = plan.tables.table(tq.block_m)
    hstu_backward_dq_kernel[(nqb, nheads)](
        **args, **tq.launch(), **_bias_args(bias),
        DO=jagged(dout), DQ=jagged(dq), QTAB=qtab, n_flat=nqb, dq_scale=alpha * scale,
    )
    # Key-major pass: its query blocks (BLOCK_M) and key blocks (BLOCK_N) index the plan.
    km = plan.key_major(tkv)
    # A key block's query range longer than `chunk` query blocks is cut into at most MAX_SPLIT pieces; its own
    # program takes the first, workers scheduled before every key block take the rest from a list built on the
    # device (block_plan.SplitList). max_seq_len only sizes the pieces: the last runs to the end of the range
    # whatever its length, and when no range can be longer than one piece nothing is split (only then are the
    # outputs, which the pieces add into, left unzeroed).
    hint = max(max_seq_len, 1)
    if interpreting:  # the offsets are on the host: a hint above the longest sequence is cut to it (it made most
        # programs empty, each a Python call in the interpreter); a smaller one is kept, as on the GPU
        hint = min(hint, max(int((offs[1:] - offs[:-1]).max()) if offs.numel() > 1 else 1, 1))
    q_blocks_max = max(1, -(-hint // tkv.block_m))
    max_split = 4 if interpreting else MAX_SPLIT
    chunk = 2 if interpreting else max(32, -(-q_blocks_max // max_split))
    if q_blocks_max > chunk:
        split = km.split_list(chunk, max_split)
        n_workers = 3 if interpreting else _workers(q.device)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    else:
        split, n_workers, chunk = None, 0, _NEVER_SPLIT
        dk, dv = _new_like(k), _new_like(v)
    lists = dict(ITEM_KB=split.kb, ITEM_LO=split.lo, ITEM_HI=split.hi, NITEMS=split.n, item_cap=split.cap) if split \
        else dict(ITEM_KB=km.ktab, ITEM_LO=km.ktab, ITEM_HI=km.ktab, NITEMS=km.ktab, item_cap=0)
    grads = {"BIAS_GRAD": True} if bias is not None and bias.args.dpos.numel() else {}
    for bias_kw in bias_passes(bias):
        hstu_backward_dkdv_kernel[((n_workers + km.n_kblocks) * nheads,)](
            **args, **tkv.launch(), **bias_kw, **grads, **lists,
            DO=jagged(dout), DK=jagged(dk), DV=jagged(dv), KTAB=km.ktab, BOUNDS=km.bounds, QLO=km.qlo, QHI=km.qhi,
            n_workers=n_workers, n_heads=nheads, plan_head=1 if vis.per_head() else 0, n_qblocks=km.n_qblocks,
            n_kblocks=km.n_kblocks, chunk=chunk, dk_scale=alpha * scale, dv_scale=scale,
        )
    return dq, dk, dv


def _prepared(q: torch.Tensor, offs: torch.Tensor, pos_w, ts_w, timestamps, with_grads: bool):
    """The kernels' relative bias (None without one, or for an empty batch)."""
    if pos_w is None or q.shape[0] == 0:
        return None
    return bias_tables.prepare(RelativeBias(pos_w, ts_w, timestamps), offs, q.shape[0], with_grads)


def _table_grads(pos_w, ts_w, timestamps, prep) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' gradients (zeros for an empty batch)."""
    if prep is None:
        return torch.zeros_like(pos_w), torch.zeros_like(ts_w)
    return bias_tables.table_grads(RelativeBias(pos_w, ts_w, timestamps), prep)


@torch.library.custom_op("flexhstu::hstu_mha_fwd", mutates_args=())
def hstu_mha_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                 func: torch.Tensor | None, num_targets: torch.Tensor | None, attn_scale: torch.Tensor | None,
                 mode: int, contextual: int, window: int, min_full: int, sparse: bool, alpha: float,
                 out_scale: float, max_seq_len: int, pos_w: torch.Tensor | None = None,
                 ts_w: torch.Tensor | None = None, timestamps: torch.Tensor | None = None) -> torch.Tensor:
    """``pos_w``, ``ts_w``, ``timestamps``: a relative bias (``flexhstu.ops.bias.RelativeBias``), or three Nones."""
    vis = Visibility(mode, func, num_targets, contextual, window, min_full, sparse)
    bias = _prepared(q, seq_offsets, pos_w, ts_w, timestamps, with_grads=False)
    return forward(q, k, v, seq_offsets, vis, alpha, out_scale, attn_scale, bias=bias)


@hstu_mha_fwd.register_fake
def _(q, k, v, seq_offsets, func, num_targets, attn_scale, mode, contextual, window, min_full, sparse, alpha,
      out_scale, max_seq_len, pos_w=None, ts_w=None, timestamps=None):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("flexhstu::hstu_mha_bwd", mutates_args=())
def hstu_mha_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                 func: torch.Tensor | None, num_targets: torch.Tensor | None, attn_scale: torch.Tensor | None,
                 mode: int, contextual: int, window: int, min_full: int, sparse: bool, alpha: float,
                 out_scale: float, max_seq_len: int, pos_w: torch.Tensor | None = None,
                 ts_w: torch.Tensor | None = None, timestamps: torch.Tensor | None = None, table_grads: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the gradients of ``pos_w`` and ``ts_w`` (with ``table_grads``; else empty tensors)."""
    vis = Visibility(mode, func, num_targets, contextual, window, min_full, sparse)
    bias = _prepared(q, seq_offsets, pos_w, ts_w, timestamps, with_grads=table_grads)
    dq, dk, dv = backward(dout, q, k, v, seq_offsets, vis, alpha, out_scale, max_seq_len, attn_scale, bias=bias)
    if pos_w is None or not table_grads:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0)
    return dq, dk, dv, *_table_grads(pos_w, ts_w, timestamps, bias)


@hstu_mha_bwd.register_fake
def _(dout, q, k, v, seq_offsets, func, num_targets, attn_scale, mode, contextual, window, min_full, sparse,
      alpha, out_scale, max_seq_len, pos_w=None, ts_w=None, timestamps=None, table_grads=False):
    if pos_w is None or not table_grads:
        tables = (q.new_empty(0), q.new_empty(0))
    else:
        tables = (torch.empty_like(pos_w), torch.empty_like(ts_w))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *tables


_NO_GRADS = (None,) * 12  # seq_offsets .. max_seq_len


def _setup_context(ctx, inputs, output):
    q, k, v, seq_offsets, func, num_targets, attn_scale, *rest = inputs
    *rest, pos_w, ts_w, timestamps = rest
    ctx.save_for_backward(q, k, v, seq_offsets, func, num_targets, attn_scale, pos_w, ts_w, timestamps)
    ctx.rest = rest


def _backward(ctx, dout):
    table_grads = ctx.saved_tensors[7] is not None and (ctx.needs_input_grad[15] or ctx.needs_input_grad[16])
    dq, dk, dv, dpos, dts = hstu_mha_bwd(dout, *ctx.saved_tensors[:7], *ctx.rest, *ctx.saved_tensors[7:],
                                         table_grads)
    if not table_grads:
        dpos = dts = None
    return dq, dk, dv, *_NO_GRADS, dpos, dts, None


hstu_mha_fwd.register_autograd(_backward, setup_context=_setup_context)


class _HstuAttention(torch.autograd.Function):
    """Eager path: the same forward/backward as the custom ops, without the op dispatch layer, with one
    block plan (given, or built here) shared by the forward and the backward; a relative bias's kernel
    tables, made once in the forward, serve the backward too."""

    @staticmethod
    def forward(ctx, q, k, v, offs, func, num_targets, attn_scale, plan, alpha, out_scale, max_seq_len,
                pos_w=None, ts_w=None, timestamps=None):
        bias = _prepared(q, offs, pos_w, ts_w, timestamps, with_grads=False)
        tile_set = call_tiles(q, v, plan.vis, bias is not None)
        out = forward(q, k, v, offs, plan.vis, alpha, out_scale, attn_scale, plan, tile_set, bias)
        ctx.save_for_backward(q, k, v, offs, func, num_targets, attn_scale)  # the mask too: what backward reads
        ctx.rest = (plan, alpha, out_scale, max_seq_len, tile_set, bias, (pos_w, ts_w, timestamps))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offs, _, _, attn_scale = ctx.saved_tensors
        plan, alpha, out_scale, max_seq_len, tile_set, bias, tables = ctx.rest
        table_grads = tables[0] is not None and (ctx.needs_input_grad[11] or ctx.needs_input_grad[12])
        if bias is not None and table_grads:
            bias = bias_tables.with_grad_buffers(bias)
        dq, dk, dv = backward(dout, q, k, v, offs, plan.vis, alpha, out_scale, max_seq_len, attn_scale, plan,
                              tile_set, bias)
        dpos = dts = None
        if table_grads:
            dpos, dts = _table_grads(*tables, bias)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dpos, dts, None


# The modes as plain ints, converted once at import: a tl.constexpr does not compare under torch.compile's
# tracing, and torch 2.11 cannot trace int() of one either.
_MODE_FUNC, _MODE_CAUSAL, _MODE_FIXED = int(MODE_FUNC), int(MODE_CAUSAL), int(MODE_FIXED)


def visibility(func=None, num_targets=None, causal_closed_form=False, contextual=0, window=0,
               min_full=0, sparse: bool | None = None, max_seq_len: int = 0) -> Visibility:
    """The kernels' mask description from triton_hstu_mha's mask arguments (num_targets made contiguous).

    ``sparse`` None decides from the mask: a fixed-rule window of at most a quarter of ``max_seq_len`` (or any
    window when ``max_seq_len`` is not given) is sparse; causal and funcs are not (a func's sparsity is only
    known from its values, which are not read here: a plan says it, ``build_plan(sparse=True)``).
    """
    if num_targets is not None:
        num_targets = num_targets.contiguous()
    if func is not None:
        mode = _MODE_FUNC
    elif causal_closed_form:
        mode = _MODE_CAUSAL
    else:
        mode = _MODE_FIXED
    if sparse is None:
        sparse = mode == _MODE_FIXED and window > 0 and (max_seq_len <= 0 or 4 * window <= max_seq_len)
    return Visibility(mode, func, num_targets, contextual, window, min_full, bool(sparse))


def _check_attn_scale(attn_scale: torch.Tensor, total: int, device: torch.device) -> None:
    if not isinstance(attn_scale, torch.Tensor):
        raise bad_value("attn_scale", "None or a float32 tensor of shape (total,)", type(attn_scale).__name__)
    want = f"a contiguous float32 tensor of shape ({total},) on {device}"
    got = f"{attn_scale.dtype} {tuple(attn_scale.shape)} on {attn_scale.device}" + (
        "" if attn_scale.is_contiguous() else " (not contiguous)")
    if (attn_scale.dtype != torch.float32 or tuple(attn_scale.shape) != (total,) or not attn_scale.is_contiguous()
            or attn_scale.device != device):
        raise bad_value("attn_scale", want, got)
    if attn_scale.requires_grad:
        raise bad_value("attn_scale", "a tensor that does not require grad (the kernels give no gradient for it)",
                        "requires_grad=True")


def triton_hstu_mha(q, k, v, seq_offsets, *, func=None, num_targets=None, causal_closed_form=False,
                    contextual: int = 0, window: int = 0, min_full: int = 0,
                    alpha: float, out_scale: float, max_seq_len: int,
                    attn_scale: torch.Tensor | None = None, plan=None,
                    rel_bias: RelativeBias | None = None) -> torch.Tensor:
    """Dispatch to the custom op. ``func`` given: the func decides; else causal or the fixed rule in closed form.

    q, k: ``(total, H, Dqk)``, v: ``(total, H, Dv)``, any strides (a non-unit last stride costs a copy);
    seq_offsets ``(B + 1,)`` and num_targets ``(B,)``: int32 or int64, any stride. Returns ``(total, H, Dv)``.

    Non-finite values are confined to their sequence: a NaN or Inf in one sequence's q, k, v (or dout)
    never reaches another sequence's output or gradients (tiles never span two sequences; rows past a
    sequence's end are read as 0). Within a sequence they are not confined by the mask: a key/value
    row that the mask hides from a query row still enters that row's products as ``0 * x`` when both
    share a tile, so a NaN or Inf there may reach rows of the same sequence that do not see it.

    ``attn_scale``: None, or float32 ``(total,)``: row ``t`` of A is scaled by ``attn_scale[t]`` instead of
    ``out_scale`` (``A = silu(S) * M * attn_scale[row]``, docs/design.md, section 10); no gradient flows to it.

    ``plan``: an ``AttnPlan`` from ``flexhstu.ops.plan.build_plan`` for these offsets and this mask, reused
    across calls (layers); checked against the call (host metadata only). Without it a plan is built per call.
    Under torch.compile the op builds its plan inside the graph (the plan is checked, then unused).

    ``max_seq_len`` is only a tuning hint (it sizes the split of long key-major ranges): any value,
    0 or smaller than the longest sequence included, gives the same result.

    ``rel_bias``: a ``flexhstu.ops.bias.RelativeBias`` (checked by the caller, ``check_relative_bias``), added
    to the scores before the silu, computed per tile from its tables (``flexhstu.ops.triton.bias_tiles``); the
    tables get gradients when they require them, the timestamps never.
    """
    for name, d in (("q.shape[2] (Dqk)", q.shape[2]), ("v.shape[2] (Dv)", v.shape[2])):
        if not head_dim_supported(d):
            raise bad_value(name, f"a head dim from {MIN_HEAD_DIM} to {MAX_HEAD_DIM} for the Triton kernels", d)
    if attn_scale is not None:
        _check_attn_scale(attn_scale, q.shape[0], q.device)
    if plan is not None:
        plan.check_triton_call(seq_offsets, q.shape[0], func=func, num_targets=num_targets,
                               causal_closed_form=causal_closed_form, contextual=contextual, window=window,
                               min_full=min_full)
    tables = (None, None, None) if rel_bias is None else tuple(rel_bias)
    # The kernels read offsets and num_targets as plain int64 / int arrays (no strides): made so here, once.
    offs = seq_offsets.to(torch.int64).contiguous()
    if torch.compiler.is_compiling():
        # The op builds its own block plan (and safe offsets) in the graph from the call's own mask: a plan
        # object is never traced (its tables are built lazily, outside any graph), it only picks the tiles.
        vis = visibility(func, num_targets, causal_closed_form, contextual, window, min_full,
                         sparse=None if plan is None else plan.sparse, max_seq_len=max_seq_len)
        return hstu_mha_fwd(q, k, v, offs, vis.func, vis.num_targets, attn_scale, vis.mode, vis.contextual,
                            vis.window, vis.min_full, vis.sparse, alpha, out_scale, max_seq_len, *tables)
    if plan is not None:
        block = plan.block
    else:
        block = BlockPlan(offs, q.shape[0], visibility(func, num_targets, causal_closed_form, contextual, window,
                                                       min_full, max_seq_len=max_seq_len))
    vis = block.vis
    return _HstuAttention.apply(q, k, v, block.offs, vis.func, vis.num_targets, attn_scale, block, alpha, out_scale,
                                max_seq_len, *tables)
