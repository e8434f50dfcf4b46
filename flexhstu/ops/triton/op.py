"""The torch.library custom ops of the attention (forward, backward, their fakes and autograd), the eager
autograd.Function, and ``triton_hstu_mha``, the entry point; the launches are in ``launch``."""

from __future__ import annotations

import inspect
from collections import namedtuple

import torch

from ..._errors import bad_value
from ..bias import RelativeBias
from . import bias_tables
from .block_plan import BlockPlan, Visibility
from .launch import backward, call_tiles, forward, visibility
from .limits import MAX_HEAD_DIM, MIN_HEAD_DIM, head_dim_supported


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


def _rab_grad_buffer(rab: torch.Tensor | None, wanted: bool) -> torch.Tensor | None:
    """Float32 zeros of ``rab``'s shape that the dK/dV kernel writes the dense bias's gradient into (every pair it
    does not visit, hidden or outside a sequence, keeps its 0), or None."""
    return torch.zeros(rab.shape, dtype=torch.float32, device=rab.device) if rab is not None and wanted else None


def _inputs_of(fn, name: str) -> type:
    """A NamedTuple of ``fn``'s parameters in order (``ctx`` left out): autograd's per-input tuples
    (``needs_input_grad``, the gradients returned) read and written by name, so a parameter added to ``fn``
    moves no other one's place."""
    return namedtuple(name, [p for p in inspect.signature(fn).parameters if p != "ctx"])


def _needs_grad(inputs: type, ctx) -> tuple:
    """``ctx.needs_input_grad`` as an ``inputs`` tuple (an ``_inputs_of`` tuple); the trailing inputs it lacks
    need none (a custom op's dispatcher drops those equal to their defaults, the Nones of no bias)."""
    needs = ctx.needs_input_grad
    return inputs(*needs, *(False,) * (len(inputs._fields) - len(needs)))


def _grads(inputs: type, **grads) -> tuple:
    """One gradient per input of ``inputs`` (an ``_inputs_of`` tuple), in its order: those named, None for the
    others; a name that is not an input raises."""
    return tuple(inputs(**(dict.fromkeys(inputs._fields) | grads)))


def _hstu_mha_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                  func: torch.Tensor | None, num_targets: torch.Tensor | None, attn_scale: torch.Tensor | None,
                  mode: int, contextual: int, window: int, min_full: int, sparse: bool, alpha: float,
                  out_scale: float, max_seq_len: int, pos_w: torch.Tensor | None = None,
                  ts_w: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
                  rab: torch.Tensor | None = None) -> torch.Tensor:
    """``pos_w``, ``ts_w``, ``timestamps``: a relative bias (``flexhstu.ops.bias.RelativeBias``), or three Nones;
    ``rab``: a dense bias (``rab_tiles``), or None."""
    vis = Visibility(mode, func, num_targets, contextual, window, min_full, sparse)
    bias = _prepared(q, seq_offsets, pos_w, ts_w, timestamps, with_grads=False)
    return forward(q, k, v, seq_offsets, vis, alpha, out_scale, attn_scale, bias=bias, rab=rab)


hstu_mha_fwd = torch.library.custom_op("flexhstu::hstu_mha_fwd", _hstu_mha_fwd, mutates_args=())
_FwdInputs = _inputs_of(_hstu_mha_fwd, "_FwdInputs")


@hstu_mha_fwd.register_fake
def _(q, k, v, seq_offsets, func, num_targets, attn_scale, mode, contextual, window, min_full, sparse, alpha,
      out_scale, max_seq_len, pos_w=None, ts_w=None, timestamps=None, rab=None):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("flexhstu::hstu_mha_bwd", mutates_args=())
def hstu_mha_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                 func: torch.Tensor | None, num_targets: torch.Tensor | None, attn_scale: torch.Tensor | None,
                 mode: int, contextual: int, window: int, min_full: int, sparse: bool, alpha: float,
                 out_scale: float, max_seq_len: int, pos_w: torch.Tensor | None = None,
                 ts_w: torch.Tensor | None = None, timestamps: torch.Tensor | None = None, table_grads: bool = False,
                 rab: torch.Tensor | None = None, rab_grad: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, the gradients of ``pos_w`` and ``ts_w`` (with ``table_grads``; else empty tensors) and of
    ``rab`` (with ``rab_grad``; else an empty tensor)."""
    vis = Visibility(mode, func, num_targets, contextual, window, min_full, sparse)
    bias = _prepared(q, seq_offsets, pos_w, ts_w, timestamps, with_grads=table_grads)
    drab = _rab_grad_buffer(rab, rab_grad)
    dq, dk, dv = backward(dout, q, k, v, seq_offsets, vis, alpha, out_scale, max_seq_len, attn_scale, bias=bias,
                          rab=rab, drab=drab)
    d_rab = q.new_empty(0) if drab is None else drab.to(rab.dtype)
    if pos_w is None or not table_grads:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0), d_rab
    return dq, dk, dv, *_table_grads(pos_w, ts_w, timestamps, bias), d_rab


@hstu_mha_bwd.register_fake
def _(dout, q, k, v, seq_offsets, func, num_targets, attn_scale, mode, contextual, window, min_full, sparse,
      alpha, out_scale, max_seq_len, pos_w=None, ts_w=None, timestamps=None, table_grads=False, rab=None,
      rab_grad=False):
    if pos_w is None or not table_grads:
        tables = (q.new_empty(0), q.new_empty(0))
    else:
        tables = (torch.empty_like(pos_w), torch.empty_like(ts_w))
    # Contiguous, as the real op's (a float32 buffer cast), whatever rab's strides.
    d_rab = q.new_empty(0)
    if rab is not None and rab_grad:
        d_rab = torch.empty(rab.shape, dtype=rab.dtype, device=rab.device)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *tables, d_rab


def _setup_context(ctx, inputs, output):
    # The optional tensors (None or a tensor) go through save_for_backward too; the ints, floats and bools
    # are never None, so a None marks a tensor argument as surely as a tensor does.
    inputs = _FwdInputs(*inputs)._asdict()
    tensors = {name: x for name, x in inputs.items() if x is None or isinstance(x, torch.Tensor)}
    ctx.save_for_backward(*tensors.values())
    ctx.tensor_names = tuple(tensors)
    ctx.rest = {name: x for name, x in inputs.items() if name not in tensors}


def _backward(ctx, dout):
    inputs = _FwdInputs(**dict(zip(ctx.tensor_names, ctx.saved_tensors)), **ctx.rest)
    needs = _needs_grad(_FwdInputs, ctx)
    table_grads = inputs.pos_w is not None and (needs.pos_w or needs.ts_w)
    rab_grad = inputs.rab is not None and needs.rab
    dq, dk, dv, dpos, dts, d_rab = hstu_mha_bwd(dout, **inputs._asdict(), table_grads=table_grads, rab_grad=rab_grad)
    if not table_grads:
        dpos = dts = None
    return _grads(_FwdInputs, q=dq, k=dk, v=dv, pos_w=dpos, ts_w=dts, rab=d_rab if rab_grad else None)


hstu_mha_fwd.register_autograd(_backward, setup_context=_setup_context)


class _HstuAttention(torch.autograd.Function):
    """Eager path: the same forward/backward as the custom ops, without the op dispatch layer, with one
    block plan (given, or built here) shared by the forward and the backward; a relative bias's kernel
    tables, made once in the forward, serve the backward too."""

    @staticmethod
    def forward(ctx, q, k, v, offs, func, num_targets, attn_scale, plan, alpha, out_scale, max_seq_len,
                pos_w=None, ts_w=None, timestamps=None, rab=None):
        bias = _prepared(q, offs, pos_w, ts_w, timestamps, with_grads=False)
        tile_set = call_tiles(q, v, plan.vis, bias is not None or rab is not None)
        out = forward(q, k, v, offs, plan.vis, alpha, out_scale, attn_scale, plan, tile_set, bias, rab)
        # The mask too: what backward reads.
        ctx.save_for_backward(q, k, v, offs, func, num_targets, attn_scale, rab)
        ctx.rest = (plan, alpha, out_scale, max_seq_len, tile_set, bias, (pos_w, ts_w, timestamps))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offs, _, _, attn_scale, rab = ctx.saved_tensors
        plan, alpha, out_scale, max_seq_len, tile_set, bias, tables = ctx.rest
        pos_w, ts_w, timestamps = tables
        table_grads, drab = False, None
        if pos_w is not None or rab is not None:  # without a bias only q, k and v have gradients
            needs = _needs_grad(_EagerInputs, ctx)
            table_grads = pos_w is not None and (needs.pos_w or needs.ts_w)
            if bias is not None and table_grads:
                bias = bias_tables.with_grad_buffers(bias)
            drab = _rab_grad_buffer(rab, needs.rab)
        dq, dk, dv = backward(dout, q, k, v, offs, plan.vis, alpha, out_scale, max_seq_len, attn_scale, plan,
                              tile_set, bias, rab, drab)
        if not table_grads and drab is None:
            return (dq, dk, dv, *_NO_GRADS_BUT_QKV)  # as _grads would: the others' are None
        dpos = dts = None
        if table_grads:
            dpos, dts = _table_grads(pos_w, ts_w, timestamps, bias)
        return _grads(_EagerInputs, q=dq, k=dk, v=dv, pos_w=dpos, ts_w=dts,
                      rab=None if drab is None else drab.to(rab.dtype))


_EagerInputs = _inputs_of(_HstuAttention.forward, "_EagerInputs")
assert _EagerInputs._fields[:3] == ("q", "k", "v")
_NO_GRADS_BUT_QKV = (None,) * (len(_EagerInputs._fields) - 3)


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
                    rel_bias: RelativeBias | None = None, rab: torch.Tensor | None = None,
                    plan_checked: bool = False) -> torch.Tensor:
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
    ``plan_checked``: the caller has checked the plan against this call already (``hstu_mha`` does, on its
    own mask arguments) and the check is not repeated; nor are the head dims (``hstu_mha``'s capability check).

    ``max_seq_len`` is only a tuning hint (it sizes the split of long key-major ranges): any value,
    0 or smaller than the longest sequence included, gives the same result.

    ``rel_bias``: a ``flexhstu.ops.bias.RelativeBias`` (checked by the caller, ``check_relative_bias``), added
    to the scores before the silu, computed per tile from its tables (``flexhstu.ops.triton.bias_tiles``); the
    tables get gradients when they require them, the timestamps never. ``rab``: a dense bias instead, ``(B, N,
    N)`` or ``(B, 1 or H, N, N)`` with ``N = max_seq_len`` (checked by the caller, ``check_rab``), read per tile
    (``flexhstu.ops.triton.rab_tiles``), with a gradient when it requires one.
    """
    if not plan_checked:
        for name, d in (("q.shape[2] (Dqk)", q.shape[2]), ("v.shape[2] (Dv)", v.shape[2])):
            if not head_dim_supported(d):
                raise bad_value(name, f"a head dim from {MIN_HEAD_DIM} to {MAX_HEAD_DIM} for the Triton kernels", d)
    if attn_scale is not None:
        _check_attn_scale(attn_scale, q.shape[0], q.device)
    if plan is not None and not plan_checked:
        plan.check_triton_call(seq_offsets, q.shape[0], func=func, num_targets=num_targets,
                               causal_closed_form=causal_closed_form, contextual=contextual, window=window,
                               min_full=min_full)
    tables = (None, None, None) if rel_bias is None else tuple(rel_bias)
    if rab is not None and rab.stride(-1) != 1:  # the kernels read rows of it; any other layout is copied once
        rab = rab.contiguous()
    if torch.compiler.is_compiling():
        # The kernels read offsets and num_targets as plain int64 / int arrays (no strides): made so here, once.
        offs = seq_offsets.to(torch.int64).contiguous()
        # The op builds its own block plan (and safe offsets) in the graph from the call's own mask: a plan
        # object is never traced (its tables are built lazily, outside any graph), it only picks the tiles.
        vis = visibility(func, num_targets, causal_closed_form, contextual, window, min_full,
                         sparse=None if plan is None else plan.sparse, max_seq_len=max_seq_len)
        return hstu_mha_fwd(q, k, v, offs, vis.func, vis.num_targets, attn_scale, vis.mode, vis.contextual,
                            vis.window, vis.min_full, vis.sparse, alpha, out_scale, max_seq_len, *tables, rab)
    if plan is not None:
        block = plan.block  # its offsets are made int64 and contiguous once
    else:
        offs = seq_offsets.to(torch.int64).contiguous()
        block = BlockPlan(offs, q.shape[0], visibility(func, num_targets, causal_closed_form, contextual, window,
                                                       min_full, max_seq_len=max_seq_len))
    vis = block.vis
    # The bias arguments only when there is a bias: autograd.Function.apply costs per argument (0.8 us for the four
    # Nones), and the forward's defaults are those Nones.
    bias_args = () if rel_bias is None and rab is None else (*tables, rab)
    return _HstuAttention.apply(q, k, v, block.offs, vis.func, vis.num_targets, attn_scale, block, alpha, out_scale,
                                max_seq_len, *bias_args)
