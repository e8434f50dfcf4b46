"""The STU stack run for new rows against cached histories: one ``delta_hstu_mha`` call per layer.

Reproduces ``flexhstu.nn.STULayer`` in eval mode (no dropout) from its
parameters: ``x -> LN -> [u|v|q|k]``, ``a = attention(q, [K_hist | k], [V_hist | v])``,
``x + W [silu(u), a, silu(u) * LN(a)]``. Every user's key/value sequence is its
cached history followed by its new rows, so the new rows sit at local positions
``L_hist + r``; masks are written for that whole sequence and read at the new rows.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._errors import bad_value
from ..jagged import check_offsets_meta, check_offsets_values, row_coords
from ..nn import STULayer, STUStack
from ..nn.stu import check_rows
from ..ops.delta import delta_hstu_mha
from ..ops.fp8 import E4M3, quantize_fp8
from ..ops.plan import DeltaPlan
from .cache import HistoryCache, JaggedHistory, UserHistory

MaskFn = Callable[[torch.Tensor, int], dict]
"""``(kv_offsets (B + 1,), total_kv) -> hstu_mha mask keywords`` for the whole sequences (history + new rows),
e.g. ``{"attn_func": masks.onerank(...)}`` or ``{"num_targets": nt}``; ``{}`` is causal."""


class DeltaLayout(NamedTuple):
    """Where the new rows go: ``kv_offsets (B + 1,)`` jag ``[history | new rows]`` per user (``total_kv`` rows);
    ``new_rows (T_n,)`` are the new rows' places there and ``hist_rows (T_h,)`` the history's (None with room:
    nothing reads them there); ``new_offsets (B + 1,)`` jag the new rows, ``new_seq (T_n,)`` is each new row's
    user and ``q_start (B,)`` (the history lengths) the position of each user's first new row. With room (the
    history's spare rows, ``JaggedHistory``), ``slot_offsets (B + 1,)`` jag the slots ``[history | room]`` (the
    last slot runs to the buffer's end), ``slot_rows (T_n,)`` are the new rows' places there and ``kv_lengths
    (B,)`` the rows in use. ``plan`` (``delta_layout`` makes one) is shared by the layers' delta calls, which
    follow the same offsets: the first makes the kernel's tables from them and the others reuse those."""

    kv_offsets: torch.Tensor
    hist_rows: torch.Tensor | None
    new_rows: torch.Tensor
    new_offsets: torch.Tensor
    new_seq: torch.Tensor
    q_start: torch.Tensor
    total_kv: int
    slot_offsets: torch.Tensor | None = None
    slot_rows: torch.Tensor | None = None
    kv_lengths: torch.Tensor | None = None
    plan: DeltaPlan | None = None


class NewRowsMask(NamedTuple):
    """A mask given for the new rows alone: ``rows(layout) -> hstu_mha mask keywords``, its ``attn_func`` one
    column per new row. Unlike a ``MaskFn`` it builds nothing for the history and reads no host count of its
    rows, so a captured micro-batch (``GraphPool``) stays right for histories of any length."""

    rows: Callable[[DeltaLayout], dict]


def new_row_coords(layout: DeltaLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each new row: its local position in its user's whole sequence, that sequence's length (history and
    new rows) and the user's count of new rows; int64 ``(T_n,)`` each, sync-free."""
    seq = layout.new_seq
    new_len = layout.new_offsets.diff()
    r = torch.arange(seq.numel(), device=seq.device) - layout.new_offsets[seq]
    start = layout.q_start[seq]
    return start + r, start + new_len[seq], new_len[seq]


def delta_layout(
    hist_offsets: torch.Tensor,
    new_offsets: torch.Tensor,
    total_hist: int,
    total_new: int,
    room: int = 0,
    rows: int | None = None,
) -> DeltaLayout:
    """Sync-free: the totals are host ints from the caller. With ``room``, ``rows`` is the history buffer's row
    count (default: the histories and their room, ``total_hist + B room``); the last slot runs to it."""
    hist_offsets, new_offsets = hist_offsets.to(torch.int64), new_offsets.to(torch.int64)
    users = torch.arange(hist_offsets.numel() - 1, device=hist_offsets.device)
    hist_len, new_len = hist_offsets.diff(), new_offsets.diff()
    # Each row's user, from the offsets by search: in bounds whatever the offsets hold (repeat_interleave with
    # an output size writes past its output when the lengths do not add up to it).
    seq_n = row_coords(new_offsets, total_new)[0]
    new_rows = torch.arange(total_new, device=users.device) + hist_offsets[seq_n + 1]
    layout = DeltaLayout(
        hist_offsets + new_offsets,
        None,
        new_rows,
        new_offsets,
        seq_n,
        hist_len,
        total_hist + total_new,
        plan=DeltaPlan(),
    )
    if not room:
        seq_h = row_coords(hist_offsets, total_hist)[0]
        return layout._replace(hist_rows=torch.arange(total_hist, device=users.device) + new_offsets[seq_h])
    slots = torch.arange(users.numel() + 1, device=users.device) * room + hist_offsets
    if rows is not None:  # a fill with a host constant, no copy: a captured graph keeps it for any history
        slots = slots.masked_fill(torch.arange(users.numel() + 1, device=users.device) == users.numel(), rows)
    slot_rows = new_rows - new_offsets[seq_n] + slots[seq_n] - hist_offsets[seq_n]
    return layout._replace(slot_offsets=slots, slot_rows=slot_rows, kv_lengths=hist_len + new_len)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """``x``, or its bytes for e4m3 (index_copy has no float8 kernel on the CPU)."""
    return x.view(torch.uint8) if x.dtype == E4M3 else x


def _merge(hist: torch.Tensor, new: torch.Tensor, layout: DeltaLayout) -> torch.Tensor:
    out = new.new_empty(layout.total_kv, *new.shape[1:])
    _bytes(out).index_copy_(0, layout.hist_rows, _bytes(hist)).index_copy_(0, layout.new_rows, _bytes(new))
    return out


def _keys_and_values(hist, new, layout: DeltaLayout) -> tuple[list[torch.Tensor], dict]:
    """The whole sequences' tensors (K, V and, with e4m3 ones, their scales) and the delta call's layout keywords:
    each history tensor (``hist``) with the new rows' (``new``) written into its room (no copy of the history),
    or history and new rows merged into new tensors."""
    if layout.slot_rows is None:
        return [_merge(h, n, layout) for h, n in zip(hist, new)], dict(seq_offsets=layout.kv_offsets)
    for h, n in zip(hist, new):
        _bytes(h).index_copy_(0, layout.slot_rows, _bytes(n))
    return list(hist), dict(seq_offsets=layout.slot_offsets, kv_lengths=layout.kv_lengths)


def layer_delta(
    layer: STULayer,
    x: torch.Tensor,
    hist_k: torch.Tensor,
    hist_v: torch.Tensor,
    layout: DeltaLayout,
    max_seq_len: int,
    mask_kwargs: dict,
    hist_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One STU layer for new rows ``x (T_n, D)`` -> (output ``(T_n, D)``, ``k (T_n, H, Dqk)``, ``v (T_n, H, Dv)``).
    With ``hist_scales`` (``k_scale``, ``v_scale`` of e4m3 ``hist_k``, ``hist_v``) the attention runs in e4m3: the new
    rows' q, k, v are quantized (``flexhstu.quantize_fp8``) and the returned ``k``, ``v`` are those before it."""
    cfg = layer.cfg
    h, da, dh = cfg.num_heads, cfg.attention_dim, cfg.hidden_dim
    u, v, q, k = torch.split(layer.uvqk(layer.norm(x)), [h * dh, h * dh, h * da, h * da], dim=-1)
    q, k, v = q.reshape(-1, h, da), k.reshape(-1, h, da), v.reshape(-1, h, dh)
    if hist_scales is None:
        (keys, values), where = _keys_and_values((hist_k, hist_v), (k, v), layout)
        query, fp8 = q, {}
    else:
        (query, qs), (k8, ks), (v8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
        (keys, values, kscale, vscale), where = _keys_and_values(
            (hist_k, hist_v, *hist_scales), (k8, v8, ks, vs), layout
        )
        fp8 = dict(fp8_scales=(qs, kscale, vscale))
    a = (
        delta_hstu_mha(
            max_seq_len,
            None,
            query,
            keys,
            values,
            kernel=cfg.kernel,
            q_offsets=layout.new_offsets,
            q_start=layout.q_start,
            delta_plan=layout.plan,
            **where,
            **mask_kwargs,
            **fp8,
        )
        .reshape(-1, h * dh)
        .to(x.dtype)
    )
    su = F.silu(u)
    return x + layer.out(torch.cat([su, a, su * layer.attn_norm(a)], dim=-1)), k, v


def stack_delta(
    stack: STUStack,
    x: torch.Tensor,
    history: JaggedHistory,
    new_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    mask: MaskFn | NewRowsMask | None = None,
) -> tuple[torch.Tensor, list, list]:
    """The stack (final norm included) for new rows ``x (T_n, D)`` jagged by ``new_offsets (B + 1,)`` after the
    cached ``history``. Returns (outputs ``(T_n, D)``, per-layer new ``k``, per-layer new ``v``)."""
    biased = [i for i, layer in enumerate(stack.layers) if layer.rel_bias is not None]
    if biased:  # the cache keeps no event times and delta_hstu_mha takes no bias: refuse, never drop the bias
        raise bad_value(
            "stack",
            "STU layers without a relative attention bias for cached serving (the delta path "
            "has no bias yet; build the model with rel_bias=False)",
            f"rel_bias on layer {biased[0]}",
        )
    _check_history(stack, history)
    if history.room:  # a row past a user's room would overwrite the next user's history
        _check_room(new_offsets, history.room)
    rows = history.k[0].shape[0]
    # The history rows: with room, the lengths' sum (a kept buffer, GraphPool's, may have rows to spare).
    total_hist = sum(history.lengths) if history.room else rows
    layout = delta_layout(history.offsets, new_offsets, total_hist, x.shape[0], history.room, rows)
    if isinstance(mask, NewRowsMask):
        mask_kwargs = dict(mask.rows(layout))
    else:
        mask_kwargs = {} if mask is None else dict(mask(layout.kv_offsets, layout.total_kv))
        if "attn_func" in mask_kwargs:  # one column per query row: the new rows' columns of the whole func
            mask_kwargs["attn_func"] = mask_kwargs["attn_func"][:, :, layout.new_rows]
    ks, vs = [], []
    scales = zip(history.k_scale, history.v_scale) if history.fp8 else [None] * len(stack.layers)
    for layer, hk, hv, hs in zip(stack.layers, history.k, history.v, scales):
        x, k, v = layer_delta(layer, x, hk, hv, layout, max_seq_len, mask_kwargs, hs)
        ks.append(k), vs.append(v)
    return stack.norm(x), ks, vs


def empty_history(stack: STUStack, batch: int, like: torch.Tensor) -> JaggedHistory:
    """``batch`` users with no history rows (dtype and device of ``like``)."""
    cfg = stack.layers[0].cfg
    k = [like.new_empty(0, cfg.num_heads, cfg.attention_dim) for _ in stack.layers]
    v = [like.new_empty(0, cfg.num_heads, cfg.hidden_dim) for _ in stack.layers]
    return JaggedHistory(k, v, torch.zeros(batch + 1, dtype=torch.int64, device=like.device), [0] * batch)


@torch.no_grad()
def prefill(
    stack: STUStack,
    cache: HistoryCache,
    users: Sequence[Hashable],
    x: torch.Tensor,
    seq_offsets: torch.Tensor,
    mask: MaskFn | None = None,
) -> torch.Tensor:
    """Run the stack over whole histories ``x (T_h, D)`` (jagged by ``seq_offsets (B + 1,)``, one per user),
    store each user's K and V (replacing what was cached) and return the outputs ``(T_h, D)``.
    ``mask`` is the histories' mask (causal when None). Reads the offsets once (a sync on CUDA)."""
    _check_stack(stack, cache, x)
    _check_users(users, seq_offsets)
    offs = _read_offsets(seq_offsets, "seq_offsets", x)
    _check_cache_fits(cache, users, offs)  # before any work: a refused call leaves the cache as it was
    history = empty_history(stack, len(users), x)
    out, ks, vs = stack_delta(stack, x, history, seq_offsets, max_seq_len=cache.max_seq_len, mask=mask)
    _store(cache.put, users, offs, out, ks, vs)
    return out


@torch.no_grad()
def extend(
    stack: STUStack,
    cache: HistoryCache,
    users: Sequence[Hashable],
    x: torch.Tensor,
    new_offsets: torch.Tensor,
    mask: MaskFn | None = None,
) -> torch.Tensor:
    """Append rows ``x (T_n, D)`` (jagged by ``new_offsets``) to cached users' histories; return their outputs.

    Equal to ``prefill`` of the grown histories when the rows' inputs ``x`` are what a full run would give
    them and earlier rows never see later ones (causal-like masks)."""
    _check_stack(stack, cache, x)
    _check_users(users, new_offsets)
    offs = _read_offsets(new_offsets, "new_offsets", x)
    _check_cache_fits(cache, users, offs, grown=True)
    history = cache.gather(users)
    out, ks, vs = stack_delta(stack, x, history, new_offsets, max_seq_len=cache.max_seq_len, mask=mask)
    _store(cache.append, users, offs, out, ks, vs)
    return out


def _store(write, users, offs: list[int], out: torch.Tensor, ks: list, vs: list) -> None:
    for b, user in enumerate(users):
        lo, hi = offs[b], offs[b + 1]
        # Copies: a view would keep the whole batch's tensors alive after other users are evicted.
        write(
            user,
            UserHistory(
                [k[lo:hi].clone() for k in ks], [v[lo:hi].clone() for v in vs], out[hi - 1].clone() if hi > lo else None
            ),
        )


def _read_offsets(offsets: torch.Tensor, arg: str, x: torch.Tensor) -> list[int]:
    """The offsets as host ints, checked to jag the rows of ``x`` (one read: prefill and extend need the values
    to store the cache anyway)."""
    check_offsets_meta(offsets, arg)
    offs = offsets.detach().to("cpu", torch.int64)
    check_offsets_values(offs, arg, total=x.shape[0])
    return offs.tolist()


def _check_cache_fits(cache: HistoryCache, users: Sequence[Hashable], offs: list[int], grown: bool = False) -> None:
    """Every user's history (its cached rows too when ``grown``) within the cache's ``max_seq_len``."""
    for b, user in enumerate(users):
        rows = offs[b + 1] - offs[b] + (cache.length(user) if grown else 0)
        if rows > cache.max_seq_len:
            what = "cached and new rows" if grown else "rows"
            raise bad_value(
                f"history of user {user!r}",
                f"at most the cache's max_seq_len={cache.max_seq_len} rows",
                f"{rows} {what}",
            )


def _check_stack(stack: STUStack, cache: HistoryCache, x: torch.Tensor) -> None:
    """The stack fits the cache (one K and V per layer) and ``x`` fits the stack; no autocast: the cache holds
    K and V in the stack's dtype, and scores from it equal a full recompute in that dtype."""
    if len(stack.layers) != cache.num_layers:
        raise bad_value("stack", f"{cache.num_layers} STU layers (the cache's num_layers)", len(stack.layers))
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
        raise bad_value(
            "torch.autocast", "off for cached serving (cast the model instead, e.g. model.bfloat16())", "on"
        )
    w = stack.layers[0].uvqk.weight
    check_rows(x, stack.norm.normalized_shape[0], (w.dtype,), w.device, autocast_ok=False)


def _check_history(stack: STUStack, history: JaggedHistory) -> None:
    """Per layer, cached K and V of the stack's heads, dims and dtype, or e4m3 with their scales (a shorter
    history would silently skip layers: ``zip`` stops at the shorter list)."""
    if len(history.k) != len(stack.layers) or len(history.v) != len(stack.layers):
        raise bad_value(
            "history", f"K and V for the stack's {len(stack.layers)} layers", f"{len(history.k)} and {len(history.v)}"
        )
    if history.fp8:
        _check_scales(history)
    for i, (layer, hk, hv) in enumerate(zip(stack.layers, history.k, history.v)):
        cfg, dtype = layer.cfg, E4M3 if history.fp8 else layer.uvqk.weight.dtype
        for name, t, dim in (("k", hk, cfg.attention_dim), ("v", hv, cfg.hidden_dim)):
            if t.dim() != 3 or tuple(t.shape[1:]) != (cfg.num_heads, dim) or t.dtype != dtype:
                raise bad_value(
                    f"history.{name}[{i}]",
                    f"(rows, {cfg.num_heads}, {dim}) {dtype} (layer {i}'s heads and dims)",
                    f"{tuple(t.shape)} {t.dtype}",
                )


def _check_scales(history: JaggedHistory) -> None:
    """An e4m3 history's scales: per layer float32 ``(rows, H)`` of its K and V, on their device."""
    for name, scales, parts in (("k_scale", history.k_scale, history.k), ("v_scale", history.v_scale, history.v)):
        if not isinstance(scales, (list, tuple)) or len(scales) != len(parts):
            got = f"{len(scales)} tensors" if isinstance(scales, (list, tuple)) else type(scales).__name__
            raise bad_value(f"history.{name}", f"one scale tensor per layer ({len(parts)}, quantize_history)", got)
        for i, (s, t) in enumerate(zip(scales, parts)):
            ok = isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.device == t.device
            if not ok or tuple(s.shape) != tuple(t.shape[:2]):
                got = f"{tuple(s.shape)} {s.dtype} on {s.device}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise bad_value(
                    f"history.{name}[{i}]", f"{tuple(t.shape[:2])} torch.float32 on {t.device} (rows, heads)", got
                )


def _check_users(users: Sequence[Hashable], offsets: torch.Tensor) -> None:
    if len(users) != offsets.numel() - 1:
        raise bad_value("users", f"one user per sequence ({offsets.numel() - 1})", len(users))
    if len(set(users)) != len(users):
        raise bad_value("users", "distinct users", list(users))


def _check_room(new_offsets: torch.Tensor, room: int) -> None:
    new_len = new_offsets.to(torch.int64).diff()
    if new_offsets.is_cuda:  # no sync: a device-side assertion (none in a CUDA graph: MicroBatchGraphs' callers
        if torch.cuda.is_current_stream_capturing():  # size the room from the host counts)
            return
        torch._assert_async((new_len <= room).all(), "new rows per user: expected at most the history's room")
        return
    if new_len.numel() and int(new_len.max()) > room:
        b = int(torch.argmax(new_len))
        raise bad_value(
            f"new rows of user {b}", f"at most the history's room of {room} rows (HistoryCache.gather)", int(new_len[b])
        )
