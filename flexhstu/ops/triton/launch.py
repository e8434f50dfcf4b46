"""The kernels' launches: ``forward`` and ``backward`` (tiles, block plan, bias passes, the key-major split), their
arguments, and ``visibility`` (the kernels' mask description from ``triton_hstu_mha``'s mask arguments)."""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction

from . import bias_tables
from .args import jagged
from .backward import hstu_backward_dkdv_kernel, hstu_backward_dq_kernel, zero_split_rows_kernel
from .block_plan import BlockPlan, Visibility
from .config import Tiles, tiles
from .debug import poisoning
from .fast_launch import Launcher
from .forward import hstu_forward_kernel
from .limits import tile_dim
from .rab_tiles import rab_args
from .row_intervals import BIG, MODE_CAUSAL, MODE_FIXED, MODE_FUNC

_NEVER_SPLIT = int(BIG)
"""A chunk longer than any key block's query range (in query blocks)."""
MAX_SPLIT = 16
"""Pieces a long key-major range is cut into at most (a power of two). Each piece's partial dK, dV is added
atomically in the outputs' dtype, so more pieces mean more roundings of bf16 sums; 16 pieces of 256 query
blocks of 32 rows cover a 131,072-row SLA prefix column with no piece longer than the average walk."""
_SMS: dict[torch.device, int] = {}
_FORWARD, _DQ = Launcher(hstu_forward_kernel), Launcher(hstu_backward_dq_kernel)
_DKDV, _ZERO_SPLIT_ROWS = Launcher(hstu_backward_dkdv_kernel), Launcher(zero_split_rows_kernel)


def _workers(device: torch.device) -> int:
    """Split-list workers per head: two per multiprocessor, enough to start every piece at once on the usual
    batches (an idle worker reads one count and exits)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
            else 4
    return 2 * _SMS[device]


_INTERPRETED = not isinstance(hstu_forward_kernel, JITFunction)
"""Whether the kernels run in Triton's interpreter: decided when ``triton.jit`` made them, at import
(``TRITON_INTERPRET=1``), so read from them rather than from the environment on every call."""


def _interpreting() -> bool:
    return _INTERPRETED


def _new_like(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous uninitialised tensor of ``x``'s dtype and device, of ``shape`` or ``x``'s shape."""
    if shape:
        out = torch.empty(*shape, dtype=x.dtype, device=x.device)
    else:  # the same tensor as torch.empty(*x.shape, ...), made in less host time
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out.fill_(float("nan")) if poisoning() else out


def _last_dim_contiguous(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: float32 inputs honour ``torch.backends.cuda.matmul.allow_tf32``
    (IEEE fp32 products when it is False); half types multiply exactly in any case ("tf32", the default)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _call_class(q, v, alpha: float, biased: bool) -> tuple[int, int, bool, str]:
    """What a call's kept arguments depend on besides the mask, the tiles and the switches: the head dims, FLOOR_SCORES
    and the dot precision. FLOOR_SCORES: with ``|alpha| > 1`` a finite ``q.k`` can overflow to -inf in ``alpha
    q.k``, and with a bias (``biased``: tables or a dense rab) a score can be -inf whatever alpha (a -inf entry
    hiding a pair), so the scores are floored (``silu.finite_below``); with ``|alpha| <= 1`` and no bias they
    cannot, and the kernels skip that step."""
    return q.shape[2], v.shape[2], abs(alpha) > 1.0 or biased, dot_precision(q.dtype)


def _attention_args(q, k, v, offs, vis: Visibility, alpha: float, interpreting: bool, biased: bool = False) -> dict:
    """Arguments of the three attention kernels: Q, K, V, the mask, the head dims, the sigmoid switch
    (tanh.approx on the GPU; the interpreter has no inline PTX), the dot precision and FLOOR_SCORES
    (``_call_class``). All but Q, K, V and alpha are made once per mask and offsets (``Visibility.cached_args``)."""
    dqk, dv, floor, precision = _call_class(q, v, alpha, biased)
    static = _static_args(offs, vis, dqk, dv, interpreting, floor, precision)
    return dict(static, Q=jagged(q), K=jagged(k), V=jagged(v), alpha=alpha)


def _static_args(offs, vis: Visibility, dqk: int, dv: int, interpreting: bool, floor: bool, precision: str) -> dict:
    """``_attention_args`` but Q, K, V and alpha, kept (``Visibility.cached_args``): FLOOR_SCORES is ``floor``,
    DOT_PRECISION ``precision``."""
    return vis.cached_args(offs, ("attention", dqk, dv, interpreting, floor, precision), lambda: dict(
        OFFS=offs, DIM_QK=dqk, DIM_V=dv, TILE_QK=tile_dim(dqk), TILE_V=tile_dim(dv), FAST_SIGMOID=not interpreting,
        FLOOR_SCORES=floor, DOT_PRECISION=precision, **vis.kernel_args(offs)))


def _query_major_args(plan: BlockPlan, vis: Visibility, tile, static: dict, scaled: bool) -> dict:
    """A query-major launch's (forward, dQ) arguments that depend on the plan and the call's class only (kept by
    the caller, ``Visibility.cached_args``, keyed by ``static``'s key, the tile and ``scaled``): ``static``
    (``_static_args``), the tile's, HAS_ATTN_SCALE, the block table QTAB and its length ``n_flat``."""
    qtab, nqb = plan.tables.table(tile.block_m)
    return dict(static, **tile.launch(), HAS_ATTN_SCALE=scaled, QTAB=qtab, n_flat=nqb)


def _bias_args(bias: bias_tables.Prepared | None) -> dict:
    """The relative bias's kernel arguments (none without one: the kernels compile as before)."""
    return {} if bias is None else dict(BIAS=bias.args, HAS_BIAS=True)


def _rab_args(rab: torch.Tensor | None) -> dict:
    """A dense bias's kernel arguments (none without one)."""
    return {} if rab is None else dict(RAB=rab_args(rab), HAS_RAB=True)


def bias_passes(bias: bias_tables.Prepared | None) -> tuple[dict, ...]:
    """The dK/dV kernel's launches and their bias arguments: one without a bias; with one, a launch for the
    sequences without a wide chunk and one (WIDE_PASS, the int64 path compiled in) for those with one
    (``Bias.seq_wide``, on the device: which sequences are wide is not read here, so both always run, and a
    program of the other kind returns at once). The query-major kernels (forward, dQ) keep both copies of
    their walk in one launch: split in two launches they ran 4% slower forward on an H100, while the dK/dV
    kernel ran faster.
    """
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
            tile_set: Tiles | None = None, bias: bias_tables.Prepared | None = None,
            rab: torch.Tensor | None = None) -> torch.Tensor:
    """``out_scale`` scales every row; with ``attn_scale`` (float32 ``(total,)``) row ``t`` is scaled by
    ``attn_scale[t]`` instead. ``tile_set``: the call's tiles (``call_tiles`` when None). ``bias``: a
    relative bias (``bias.prepare``) added to the scores; ``rab``: a dense one, ``(B, [1 or H,] N, N)``
    (``rab_tiles``)."""
    q, k, v = _last_dim_contiguous(q, k, v)
    total, nheads, _ = q.shape
    out = _new_like(q, total, nheads, v.shape[2])
    if total == 0:
        return out
    if offs.numel() == 1:  # no sequence (unchecked on CUDA): no row sees anything
        return out.zero_()
    interpreting = _interpreting()
    biased = bias is not None or rab is not None
    tile = (tile_set or call_tiles(q, v, vis, biased)).forward
    plan = plan if plan is not None else BlockPlan(offs, total, vis)
    offs = plan.offs  # safe offsets (BlockPlan.offs): the kernels never follow the caller's
    dqk, dv, floor, precision = _call_class(q, v, alpha, biased)
    scaled = attn_scale is not None
    qm = vis.cached_args(offs, ("forward", tile, dqk, dv, interpreting, floor, precision, scaled), lambda: (
        _query_major_args(plan, vis, tile, _static_args(offs, vis, dqk, dv, interpreting, floor, precision), scaled)))
    _FORWARD.launch(
        (qm["n_flat"], nheads),
        **qm, **_bias_args(bias), **_rab_args(rab), Q=jagged(q), K=jagged(k), V=jagged(v), OUT=jagged(out),
        ATTN_SCALE=attn_scale if scaled else offs, alpha=alpha, out_scale=1.0 if scaled else out_scale,
    )
    return out


def backward(dout, q, k, v, offs, vis: Visibility, alpha: float, out_scale: float, max_seq_len: int,
             attn_scale: torch.Tensor | None = None, plan: BlockPlan | None = None, tile_set: Tiles | None = None,
             bias: bias_tables.Prepared | None = None, rab: torch.Tensor | None = None,
             drab: torch.Tensor | None = None):
    """dq, dk, dv; with ``bias`` the scores include it, and when its gradient buffers are allocated
    (``bias.prepare(with_grads=True)``) the dK/dV kernel adds the tables' gradients into them. With ``rab`` the
    scores include the dense bias; ``drab`` (float32 zeros of ``rab``'s shape, or None) receives its gradient."""
    dout, q, k, v = _last_dim_contiguous(dout, q, k, v)
    total, nheads, _ = q.shape
    dq = _new_like(q)
    if total == 0:
        return dq, _new_like(k), _new_like(v)
    if offs.numel() == 1:  # no sequence (unchecked on CUDA): no gradient
        return dq.zero_(), torch.zeros_like(k), torch.zeros_like(v)
    interpreting = _interpreting()
    biased = bias is not None or rab is not None
    _, tq, tkv = tile_set or call_tiles(q, v, vis, biased)
    plan = plan if plan is not None else BlockPlan(offs, total, vis)
    offs = plan.offs  # safe offsets (BlockPlan.offs): the kernels never follow the caller's
    dqk, dv_dim, floor, precision = _call_class(q, v, alpha, biased)
    scaled = attn_scale is not None
    # The launches' kept arguments, in one look-up (_backward_args).
    qm, km, kmargs = vis.cached_args(
        offs, ("backward", tq, tkv, dqk, dv_dim, interpreting, floor, precision, scaled, max_seq_len, nheads),
        lambda: _backward_args(plan, vis, offs, tq, tkv, dqk, dv_dim, interpreting, floor, precision, scaled,
                               max_seq_len, nheads, q.device))
    # What every launch below reads per call: the inputs, the output gradient, the per-row scale (when given;
    # ``offs`` is a never-read stand-in), alpha.
    inputs = dict(Q=jagged(q), K=jagged(k), V=jagged(v), DO=jagged(dout), ATTN_SCALE=attn_scale if scaled else offs,
                  alpha=alpha)
    scale = 1.0 if scaled else out_scale  # attn_scale replaces out_scale, row by row
    _DQ.launch(
        (qm["n_flat"], nheads),
        **qm, **inputs, **_bias_args(bias), **_rab_args(rab), DQ=jagged(dq), dq_scale=alpha * scale,
    )
    dk, dv = _new_like(k), _new_like(v)
    j_dk, j_dv = jagged(dk), jagged(dv)
    zero = km["zero_split_rows"]
    if zero is not None:
        _ZERO_SPLIT_ROWS.launch(zero["grid"], **zero["args"], DK=j_dk, DV=j_dv)
    grads = {"BIAS_GRAD": True} if bias is not None and bias.args.dpos.numel() else {}
    if rab is not None:
        grads.update(_rab_args(rab))
        if drab is not None:
            shared = nheads > 1 and (drab.dim() == 3 or drab.shape[1] == 1)  # the heads' programs meet
            grads.update(DRAB=rab_args(drab), RAB_GRAD=True, RAB_SHARED=shared)
    for bias_kw in bias_passes(bias):
        _DKDV.launch(km["grid"], **kmargs, **inputs, **bias_kw, **grads, DK=j_dk, DV=j_dv, dk_scale=alpha * scale,
                     dv_scale=scale)
    return dq, dk, dv


def _backward_args(plan: BlockPlan, vis: Visibility, offs, tq, tkv, dqk: int, dv: int, interpreting: bool,
                   floor: bool, precision: str, scaled: bool, max_seq_len: int, nheads: int, device) -> tuple:
    """The backward's kept arguments (``Visibility.cached_args``): the dQ launch's (``_query_major_args``), the
    key-major ones (``_key_major_args``, kept on their own, keyed by what they depend on: they launch kernels
    when made), and the dK/dV launch's (the attention arguments, the key-major ones, HAS_ATTN_SCALE)."""
    static = _static_args(offs, vis, dqk, dv, interpreting, floor, precision)
    km = vis.cached_args(offs, ("key-major", tkv, dqk, dv, max_seq_len, nheads, interpreting),
                         lambda: _key_major_args(plan, vis, tkv, max_seq_len, nheads, interpreting, device, static))
    return _query_major_args(plan, vis, tq, static, scaled), km, dict(static, **km["args"], HAS_ATTN_SCALE=scaled)


def _key_major_args(plan: BlockPlan, vis: Visibility, tkv, max_seq_len: int, nheads: int, interpreting: bool,
                    device: torch.device, args: dict) -> dict:
    """The dK/dV launch's arguments that depend on the plan, the tile, ``max_seq_len`` and the heads only (made once
    per plan and kept, ``Visibility.cached_args``): the key-major plan, the split list, the grid; and the zeroing of
    the split key blocks' rows (None when nothing is split).

    A key block's query range longer than ``chunk`` query blocks is cut into at most MAX_SPLIT pieces; its own
    program takes the first, workers scheduled before every key block take the rest from a list built on the
    device (``block_plan.SplitList``). ``max_seq_len`` only sizes the pieces: the last runs to the end of the range
    whatever its length, and when no range can be longer than one piece (by ``max_seq_len``, or by the window under a
    window alone: ``window_query_blocks``) nothing is split (and no launch outputs left unzeroed; else only the rows
    of the split key blocks are zeroed, the others stored whole)."""
    # Key-major pass: its query blocks (BLOCK_M) and key blocks (BLOCK_N) index the plan.
    km = plan.key_major(tkv)
    offs = plan.offs
    hint = max(max_seq_len, 1)
    if interpreting:  # the offsets are on the host: a hint above the longest sequence is cut to it (it made most
        # programs empty, each a Python call in the interpreter); a smaller one is kept, as on the GPU
        hint = min(hint, max(int((offs[1:] - offs[:-1]).max()) if offs.numel() > 1 else 1, 1))
    q_blocks_max = max(1, -(-hint // tkv.block_m))
    max_split = 4 if interpreting else MAX_SPLIT
    chunk = 2 if interpreting else max(32, -(-q_blocks_max // max_split))
    if min(q_blocks_max, window_query_blocks(vis, tkv)) > chunk:
        split = km.split_list(chunk, max_split)
        n_workers = 3 if interpreting else _workers(device)
    else:
        split, n_workers, chunk = None, 0, _NEVER_SPLIT
    zero = None
    if split is not None:
        zero = dict(grid=(km.n_kblocks, nheads if vis.per_head() else 1), args=dict(
            OFFS=offs, KTAB=km.ktab, QLO=km.qlo, QHI=km.qhi, n_kblocks=km.n_kblocks, n_heads=nheads, chunk=chunk,
            PER_HEAD=vis.per_head(), CAUSAL=vis.mode == _MODE_CAUSAL, BLOCK_M=tkv.block_m, BLOCK_N=tkv.block_n,
            DIM_QK=args["DIM_QK"], DIM_V=args["DIM_V"], TILE_QK=args["TILE_QK"], TILE_V=args["TILE_V"], num_warps=4))
    lists = dict(ITEM_KB=split.kb, ITEM_LO=split.lo, ITEM_HI=split.hi, NITEMS=split.n, item_cap=split.cap) if split \
        else dict(ITEM_KB=km.ktab, ITEM_LO=km.ktab, ITEM_HI=km.ktab, NITEMS=km.ktab, item_cap=0)
    return dict(grid=((n_workers + km.n_kblocks) * nheads,), zero_split_rows=zero, args=dict(
        **tkv.launch(), **lists, KTAB=km.ktab, BOUNDS=km.bounds, QLO=km.qlo, QHI=km.qhi, n_workers=n_workers,
        n_heads=nheads, plan_head=1 if vis.per_head() else 0, n_qblocks=km.n_qblocks, n_kblocks=km.n_kblocks,
        chunk=chunk))


def window_query_blocks(vis: Visibility, tkv) -> int:
    """At most how many of the dK/dV tile's query blocks see any one key block, from the mask's host fields alone:
    under the fixed rule's window (``max_attn_len``) without targets, a contextual prefix or full-attention rows,
    the keys ``n0 .. n0 + block_n - 1`` are seen by the rows ``n0 .. n0 + block_n - 1 + window`` only; other masks
    are unbounded here (``_NEVER_SPLIT``). When it is at most the split's ``chunk`` nothing is split: no split list,
    no zeroing launch, no idle workers (a bound too small would only make a program walk more than ``chunk``
    query blocks: it still walks its whole range)."""
    if vis.mode != _MODE_FIXED or vis.window <= 0 or vis.num_targets is not None or vis.contextual or vis.min_full:
        return _NEVER_SPLIT
    return (tkv.block_n - 1 + vis.window) // tkv.block_m + 2


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
