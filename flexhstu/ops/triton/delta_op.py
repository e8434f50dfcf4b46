"""Launch of the delta forward and its torch.library custom op (with a fake, for torch.export). Forward only."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..._errors import bad_value
from ..plan import DeltaPlan
from .args import Fp8Scales, jagged
from .block_plan import Visibility
from .block_tables import block_table, safe_offsets
from .config import Tile, tiles
from .delta_kernel import delta_forward_kernel
from .fast_launch import Launcher
from .launch import _MODE_CAUSAL, _MODE_FIXED, _MODE_FUNC, _attention_args, _interpreting, _last_dim_contiguous
from .limits import tile_dim

MAX_SPLITS = 16
_DELTA = Launcher(delta_forward_kernel)
_FORCED_SPLITS: ContextVar[int | None] = ContextVar("flexhstu_delta_splits", default=None)


@contextmanager
def forced_key_splits(splits: int) -> Iterator[None]:
    """Within the block every delta call splits its key blocks ``splits`` ways (tests and benchmarks)."""
    token = _FORCED_SPLITS.set(splits)
    try:
        yield
    finally:
        _FORCED_SPLITS.reset(token)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter), so CPU tests split too."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def key_splits(programs: int, kv_blocks: int, multiprocessors: int) -> int:
    """How many splits of each program's key blocks (a power of two, at most ``MAX_SPLITS``): enough programs
    for two waves of the device when a request is small (one user's micro-batch: a few query blocks, each
    walking a long history), never fewer than four key blocks a split."""
    splits = 1
    while (splits < MAX_SPLITS and programs * splits * 2 <= 2 * multiprocessors
           and kv_blocks >= 4 * splits * 2):
        splits *= 2
    return splits


def _has_rows(total_q: int, total_kv: int, n_offsets: int) -> bool:
    """Whether a call has query rows, keys and a sequence to own them (``n_offsets = B + 1``); if not, its output
    is zeros and it launches nothing."""
    return total_q > 0 and total_kv > 0 and n_offsets >= 2


def _forward_tile(dqk: int, dv: int) -> Tile:
    return tiles(tile_dim(dqk), tile_dim(dv), _interpreting()).forward


def delta_tables(offs: torch.Tensor, q_offs: torch.Tensor, total_kv: int, total_q: int,
                 block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel follows instead of the caller's offsets: safe copies of the key and query offsets (one
    launch each, no sync; equal to them when valid: on CUDA nothing reads them, and bad ones would otherwise
    place a block table entry, a row or a key past its buffer), and the query block table of ``block_m`` rows
    (one launch). Nothing else goes into them, so calls on the same offsets can share them (``DeltaPlan``)."""
    offs, q_offs = safe_offsets(offs, total_kv), safe_offsets(q_offs, total_q)
    return offs, q_offs, block_table(q_offs, total_q, block_m)[0]


def delta_forward(delta_q, k, v, offs, q_offs, q_start, vis: Visibility, alpha: float, out_scale: float,
                  kv_lengths: torch.Tensor | None = None, tables: tuple | None = None, scales: tuple | None = None):
    """``(total_q, H, Dv)``, in ``delta_q``'s dtype, or bfloat16 with ``scales``: ``(q_scale, k_scale, v_scale)``,
    float32 ``(rows, H)`` contiguous, of e4m3 ``delta_q``, ``k``, ``v`` (``flexhstu.ops.fp8``); offsets int64,
    ``q_start (B,)`` int64, ``kv_lengths (B,)`` int64 or None (see ``delta_forward_kernel``); ``tables``:
    ``delta_tables`` of these offsets for this call's tile, made by an earlier call, or None to make them here.
    Small requests split each program's key blocks (``key_splits``) and add the splits' float32 partial sums (no
    atomics: the result does not depend on the order programs run in)."""
    delta_q, k, v = _last_dim_contiguous(delta_q, k, v)
    total_q, nheads, dqk = delta_q.shape
    dv = v.shape[2]
    out_dtype = delta_q.dtype if scales is None else torch.bfloat16
    if not _has_rows(total_q, k.shape[0], q_offs.shape[0]):
        return torch.zeros(total_q, nheads, dv, dtype=out_dtype, device=delta_q.device)
    interpreting = _interpreting()
    tile = _forward_tile(dqk, dv)
    batch = max(q_offs.shape[0] - 1, 1)
    if tables is None:
        tables = delta_tables(offs, q_offs, k.shape[0], total_q, tile.block_m)
    elif tables[2].shape[0] != total_q // tile.block_m + batch:  # the grid: one program per table entry
        raise bad_value("q_table", f"{total_q // tile.block_m + batch} entries (the query block table of "
                        f"{tile.block_m}-row blocks, delta_tables)", f"{tables[2].shape[0]} entries")
    offs, q_offs, qtab = tables
    nqb = qtab.shape[0]
    splits = _FORCED_SPLITS.get() or key_splits(nqb * nheads, -(-k.shape[0] // (batch * tile.block_n)),
                                                _multiprocessors(delta_q.device))
    out = torch.zeros(splits * total_q, nheads, dv, dtype=out_dtype if splits == 1 else torch.float32,
                      device=delta_q.device)
    # An e4m3 dot sums at least 32 products: Q K^T's tile of head dims is padded to 32 (the extra columns read 0).
    # The kernel reads scale (t, h) at t * H + h: contiguous scales (a no-op for delta_hstu_mha's, made so).
    fp8 = {} if scales is None else dict(SCALES=Fp8Scales(*(s.contiguous() for s in scales), nheads),
                                         HAS_SCALES=True, TILE_QK=max(tile_dim(dqk), 32))
    _DELTA.launch(
        (nqb, nheads, splits),
        **{**_attention_args(delta_q, k, v, offs, vis, alpha, interpreting), **fp8}, **tile.launch(),
        OUT=jagged(out), KVLEN=offs if kv_lengths is None else kv_lengths, HAS_KVLEN=kv_lengths is not None,
        QOFFS=q_offs, QSTART=q_start, QTAB=qtab, n_flat=nqb, total_q=total_q, out_scale=out_scale,
        N_SPLITS=splits,
    )
    return out if splits == 1 else out.view(splits, total_q, nheads, dv).sum(0).to(out_dtype)


@torch.library.custom_op("flexhstu::delta_hstu_mha_fwd", mutates_args=())
def delta_hstu_mha_fwd(delta_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                       q_offsets: torch.Tensor, q_start: torch.Tensor, func: torch.Tensor | None,
                       num_targets: torch.Tensor | None, mode: int, contextual: int, window: int, min_full: int,
                       alpha: float, out_scale: float, kv_lengths: torch.Tensor | None = None,
                       safe_seq_offsets: torch.Tensor | None = None, safe_q_offsets: torch.Tensor | None = None,
                       q_table: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``safe_seq_offsets``, ``safe_q_offsets``, ``q_table``: ``delta_tables`` of the offsets, all or none (the
    kernel trusts them: only the plan of ``triton_delta_hstu_mha`` passes them). ``q_scale``, ``k_scale``,
    ``v_scale``: the scales of e4m3 inputs, all or none (``delta_forward``'s ``scales``)."""
    vis = Visibility(mode, func, num_targets, contextual, window, min_full)
    tables = (safe_seq_offsets, safe_q_offsets, q_table)
    given = sum(t is not None for t in tables)
    if given not in (0, 3):
        raise bad_value("safe_seq_offsets, safe_q_offsets, q_table", "all three (delta_tables) or none",
                        ", ".join("None" if t is None else "a tensor" for t in tables))
    scales = (q_scale, k_scale, v_scale)
    scaled = sum(t is not None for t in scales)
    if scaled not in (0, 3):
        raise bad_value("q_scale, k_scale, v_scale", "all three (e4m3 inputs) or none",
                        ", ".join("None" if t is None else "a tensor" for t in scales))
    return delta_forward(delta_q, k, v, seq_offsets, q_offsets, q_start, vis, alpha, out_scale, kv_lengths,
                         tables if given else None, scales if scaled else None)


@delta_hstu_mha_fwd.register_fake
def _(delta_q, k, v, seq_offsets, q_offsets, q_start, func, num_targets, mode, contextual, window, min_full, alpha,
      out_scale, kv_lengths=None, safe_seq_offsets=None, safe_q_offsets=None, q_table=None, q_scale=None, k_scale=None,
      v_scale=None):
    dtype = delta_q.dtype if q_scale is None else torch.bfloat16
    return delta_q.new_empty(delta_q.shape[0], delta_q.shape[1], v.shape[2], dtype=dtype)


def triton_delta_hstu_mha(delta_q, k, v, seq_offsets, q_offsets, q_start, *, func=None, num_targets=None,
                          causal_closed_form=False, contextual: int = 0, window: int = 0, min_full: int = 0,
                          alpha: float, out_scale: float, kv_lengths: torch.Tensor | None = None,
                          plan: DeltaPlan | None = None, fp8_scales: tuple | None = None) -> torch.Tensor:
    """The custom op: ``func`` given decides visibility; else causal or the fixed rule in closed form. ``plan``
    keeps the offsets' tables for the next call on the same offsets (not under torch.compile, where the op
    makes its own in the graph). ``fp8_scales``: ``(q_scale, k_scale, v_scale)`` of e4m3 inputs, or None."""
    mode = _MODE_FUNC if func is not None else (_MODE_CAUSAL if causal_closed_form else _MODE_FIXED)
    as64 = lambda x: x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()
    nt = None if num_targets is None else as64(num_targets)
    kvl = None if kv_lengths is None else as64(kv_lengths)
    offs, q_offs = as64(seq_offsets), as64(q_offsets)
    tables = (None, None, None)
    total_q, total_kv = delta_q.shape[0], k.shape[0]
    if plan is not None and not torch.compiler.is_compiling() and _has_rows(total_q, total_kv, q_offs.shape[0]):
        block_m = _forward_tile(delta_q.shape[2], v.shape[2]).block_m
        tables = plan.prepared((seq_offsets, q_offsets), (total_kv, total_q, block_m),
                               lambda: delta_tables(offs, q_offs, total_kv, total_q, block_m))
    return delta_hstu_mha_fwd(delta_q, k, v, offs, q_offs, as64(q_start), func, nt, mode, contextual, window,
                              min_full, alpha, out_scale, kvl, *tables, *(fp8_scales or (None, None, None)))
