"""``hstu_mha``: check the inputs, choose a backend, run it.

Checks never read device memory of CUDA tensors (no host-device sync in the hot
path): value checks on ``seq_offsets`` / ``num_targets`` / ``max_seq_len`` run on
CPU tensors outside torch.compile; under torch.compile the offsets and targets
are asserted on the device instead; for CUDA tensors ``masks.validate`` checks
the offsets when asked.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .._errors import SPAN_MAX, as_alpha, as_bool, as_int, as_scaling, as_span, bad_type, bad_value
from ..jagged import (
    can_read_values,
    check_lengths_at_most,
    check_num_targets_meta,
    check_num_targets_values,
    check_offsets_meta,
    check_offsets_values,
    lengths_of,
    row_coords,
)
from ..masks.format import check_func_meta
from ..masks.rules import FixedRule
from .bias import RelativeBias, check_rab, check_relative_bias
from .capability import triton_unsupported_reason
from .cutlass import unavailable_reason
from .kernel import Kernel
from .plan import AttnPlan
from .pytorch import pytorch_hstu_mha

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Call(NamedTuple):
    """One checked call: what every backend runs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_offsets: torch.Tensor
    mask: torch.Tensor | FixedRule  # the func, or the fixed rule's parameters
    alpha: float
    scaling: float  # divides every row when attn_scale is None
    attn_scale: torch.Tensor | None  # () or (total,): multiplies every row (or row t) instead
    max_seq_len: int
    dropout_pr: float  # the rate applied: 0.0 outside training
    bias: RelativeBias | torch.Tensor | None  # added to alpha * Q K^T: the tables, a dense rab, or none
    plan: AttnPlan | None  # checked against the call; the Triton kernels use it, the reference needs none


def hstu_mha(
    max_seq_len: int,
    alpha: float | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    attn_func: torch.Tensor | None = None,
    scaling_seqlen: int = -1,
    attn_scale: torch.Tensor | None = None,
    rel_bias: RelativeBias | None = None,
    rab: torch.Tensor | None = None,
    attn_plan: AttnPlan | None = None,
    kernel: Kernel = Kernel.AUTO,
) -> torch.Tensor:
    """HSTU attention over a jagged batch: ``O = (silu(alpha Q K^T [+ bias]) * M) V / scaling_seqlen``.

    The math is docs/design.md, section 4; the layout section 1; the masks section 3.

    - ``q, k``: ``(total, H, Dqk)``; ``v``: ``(total, H, Dv)``; one floating dtype
      and device. Returns ``(total, H, Dv)`` in that dtype.
    - ``seq_offsets``: ``(B + 1,)`` int32/int64, ``[0] == 0``, non-decreasing,
      ``[-1] == total``.
    - ``max_seq_len``: an upper bound on the lengths (any integer: int, numpy
      integer). It is the default output scale and a tuning hint, never what
      decides which keys are read: every backend gives the same answer for any
      value. On CPU tensors (outside torch.compile) a value below the longest
      sequence is a caller's bug and raises; on CUDA it is not checked (no sync).
    - ``alpha``: finite score scale; ``None`` means ``1/sqrt(Dqk)``.
    - ``attn_func``: int32 ``(Hf, NFUNC, total)``, ``Hf in {1, H}``; alone decides
      visibility when given (leave ``causal``, ``num_targets``, ``max_attn_len``,
      ``contextual_seq_len``, ``min_full_attn_seq_len`` at their defaults).
      Otherwise the fixed rule applies with those arguments; ``num_targets`` is an
      integer ``(B,)`` tensor with ``0 <= T <= L``.
    - ``dropout_pr``: in ``[0, 1)``, applied to ``A`` when ``training``.
    - ``scaling_seqlen``: ``<= 0`` means ``max_seq_len`` (1 when that is 0); a positive scale lies in
      ``1e-37 .. 1e37`` (its float32 reciprocal scales the output).
    - ``attn_scale``: a floating tensor, scalar ``()`` or one factor per query row
      ``(total,)``, on q's device, used instead of ``1 / scaling_seqlen`` (leave that at
      its default): ``A = silu(S) * M * attn_scale[row]`` (docs/design.md, section 10).
    - ``rel_bias``: a :class:`flexhstu.ops.bias.RelativeBias` (tables ``pos_w``, ``ts_w`` and the
      ``(total,)`` timestamps): the published HSTU's relative attention bias, added to
      ``alpha * Q K^T`` before the SiLU (the rule is in ``flexhstu.ops.bias``).
    - ``rab``: a dense bias instead, floating ``(B, N, N)`` or ``(B, 1 or H, N, N)`` with
      ``N = max_seq_len``; entry ``[b, (h,) i, j]`` is added to the score of local query ``i``, key ``j``.
      Give at most one of ``rel_bias`` and ``rab``; gradients reach the tables or ``rab``.
    - ``attn_plan``: the block plan of this batch and mask (``flexhstu.build_plan``), built once and
      reused by every layer's call, forward and backward; None builds one per call. It is checked
      against the call on every backend (host metadata, no sync): a plan of other offsets, rows or mask
      raises. The Triton kernels use it (and its ``sparse`` choice of tiles); the reference needs none.
    - ``kernel``: ``Kernel.AUTO`` runs Triton on CUDA tensors it supports and the
      PyTorch reference otherwise; an explicit backend that cannot run the call raises.
    """
    rule = FixedRule(causal, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len)
    call = _checked_call(
        max_seq_len,
        alpha,
        q,
        k,
        v,
        seq_offsets,
        rule,
        attn_func,
        dropout_pr,
        training,
        scaling_seqlen,
        attn_scale,
        rel_bias,
        rab,
        attn_plan,
    )
    backend = _choose_backend(kernel, call)
    return _BACKENDS[backend](call)


def _checked_call(
    max_seq_len,
    alpha,
    q,
    k,
    v,
    seq_offsets,
    rule,
    attn_func,
    dropout_pr,
    training,
    scaling_seqlen,
    attn_scale,
    rel_bias,
    rab,
    attn_plan,
) -> _Call:
    _check_qkv(q, k, v)
    check_offsets_meta(seq_offsets)
    device, num_targets = q.device, rule.num_targets
    if not (  # every tensor given on q's device (the common case, read directly), else the check says which is not
        seq_offsets.device == device
        and (num_targets is None or not isinstance(num_targets, torch.Tensor) or num_targets.device == device)
        and (attn_func is None or not isinstance(attn_func, torch.Tensor) or attn_func.device == device)
        and (attn_scale is None or not isinstance(attn_scale, torch.Tensor) or attn_scale.device == device)
    ):
        _check_same_device(
            q, seq_offsets=seq_offsets, num_targets=num_targets, attn_func=attn_func, attn_scale=attn_scale
        )
    max_seq_len = as_int("max_seq_len", max_seq_len)
    rule = _checked_rule(rule, seq_offsets.numel() - 1)
    if attn_func is not None:
        _check_func_alone(attn_func, rule, q)
    total = q.shape[0]
    if can_read_values(seq_offsets):
        _check_values_on_host(seq_offsets, total, max_seq_len, rule.num_targets)
    elif torch.compiler.is_compiling():
        _assert_values_on_device(seq_offsets, total, rule.num_targets)
    alpha = as_alpha(alpha, q.shape[2])
    scaling = -1.0 if scaling_seqlen is None else as_scaling("scaling_seqlen", scaling_seqlen)
    if attn_scale is not None:
        _check_attn_scale(attn_scale, total, scaling)
    if scaling <= 0:
        scaling = float(max_seq_len) or 1.0
    rate = _probability(dropout_pr) if as_bool("training", training) else 0.0
    mask = attn_func if attn_func is not None else rule
    bias = _checked_bias(rel_bias, rab, q, seq_offsets.numel() - 1, max_seq_len)
    if attn_plan is not None:
        if not isinstance(attn_plan, AttnPlan):
            raise bad_type("attn_plan", "None or an AttnPlan from flexhstu.build_plan", type(attn_plan).__name__)
        attn_plan.check(seq_offsets, total, mask)
    return _Call(q, k, v, seq_offsets, mask, alpha, scaling, attn_scale, max_seq_len, rate, bias, attn_plan)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_name: str = "q", fp8: bool = False) -> None:
    """Types, ranks, dtypes, heads and head dims of the attention inputs. With ``q_name="q"`` (training) k
    and v have q's rows; otherwise (``delta_q``, serving) v has k's rows and q is a subset of them. With ``fp8``
    (serving) all three are float8_e4m3fn."""
    if q_name == "q" and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        # What the loops below check, read once (every call passes here): any failure is left to them to name.
        qs, ks, vs, dtype = q.shape, k.shape, v.shape, q.dtype
        if (
            len(qs) == 3
            and len(ks) == 3
            and len(vs) == 3
            and dtype in _FLOAT_DTYPES
            and k.dtype == dtype
            and v.dtype == dtype
            and ks[0] == qs[0]
            and vs[0] == qs[0]
            and ks[1] == qs[1]
            and vs[1] == qs[1]
            and ks[2] == qs[2]
        ):
            return
    for name, x in ((q_name, q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise bad_type(name, "a torch.Tensor", type(x).__name__)
        if x.dim() != 3:
            raise bad_value(name, "a 3-D jagged tensor (total, H, D)", f"shape {tuple(x.shape)}")
        if fp8 and x.dtype != torch.float8_e4m3fn:
            raise bad_type(f"{name}.dtype", "torch.float8_e4m3fn with fp8_scales (flexhstu.quantize_fp8)", x.dtype)
        if not fp8 and x.dtype not in _FLOAT_DTYPES:
            hint = ""
            if x.dtype == torch.float8_e4m3fn:
                hint = (
                    " (e4m3 runs in delta_hstu_mha only)"
                    if q_name == "q"
                    else " (float8_e4m3fn inputs need fp8_scales)"
                )
            raise bad_type(name, f"float16, bfloat16, float32 or float64{hint}", x.dtype)
    rows_of, rows = (q_name, q.shape[0]) if q_name == "q" else ("k", k.shape[0])
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != rows and name != rows_of:
            raise bad_value(f"{name}.shape[0]", f"the rows of {rows_of} ({rows})", x.shape[0])
        if x.shape[1] != q.shape[1]:
            raise bad_value(f"{name}.shape[1] (heads)", f"the heads of {q_name} ({q.shape[1]})", x.shape[1])
        if x.dtype != q.dtype:
            raise bad_type(f"{name}.dtype", f"the dtype of {q_name} ({q.dtype})", x.dtype)
    if k.shape[2] != q.shape[2]:
        raise bad_value("k.shape[2] (Dqk)", f"the head dim of {q_name} ({q.shape[2]})", k.shape[2])


def _check_same_device(q: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.device != q.device:
            raise bad_value(f"{name}.device", f"the device of q ({q.device})", x.device)


def _checked_rule(rule: FixedRule, batch: int) -> FixedRule:
    causal, num_targets, window, contextual, min_full = rule
    if (
        (causal is True or causal is False)
        and type(window) is int
        and type(contextual) is int
        and type(min_full) is int
        and 0 <= window <= SPAN_MAX
        and 0 <= contextual <= SPAN_MAX
        and 0 <= min_full <= SPAN_MAX
    ):  # what as_bool and as_span leave unchanged (the common case): only num_targets is left to check
        if num_targets is not None:
            check_num_targets_meta(num_targets, batch)
        return rule
    causal = as_bool("causal", rule.causal)  # "no" or None would pass a truth test
    if rule.num_targets is not None:
        check_num_targets_meta(rule.num_targets, batch)
    spans = tuple(as_span(name, getattr(rule, name)) for name in FixedRule._fields[2:])
    if causal is rule.causal and all(a is b for a, b in zip(spans, rule[2:])):  # unchanged: no new tuple
        return rule
    return FixedRule(causal, rule.num_targets, *spans)


def _check_func_alone(attn_func: torch.Tensor, rule: FixedRule, q: torch.Tensor) -> None:
    causal, num_targets, window, contextual, min_full = rule
    if not (causal is True and num_targets is None and window == 0 and contextual == 0 and min_full == 0):
        defaults = FixedRule()
        extra = [n for n, val, default in zip(rule._fields, rule, defaults) if val is not default and val != default]
    else:  # every argument at its default (the common case)
        extra = []
    if extra:
        raise ValueError(
            f"attn_func: the func alone decides visibility; leave {', '.join(extra)} at the default "
            "(encode targets, windows and prefixes in the func with flexhstu.masks)"
        )
    check_func_meta(attn_func, total=q.shape[0], nheads=q.shape[1], arg="attn_func")


def _check_attn_scale(attn_scale: object, total: int, scaling: float) -> None:
    if not isinstance(attn_scale, torch.Tensor):
        raise bad_type("attn_scale", "a torch.Tensor of shape () or (total,)", type(attn_scale).__name__)
    if attn_scale.dim() != 0 and tuple(attn_scale.shape) != (total,):
        expected = f"shape () or one factor per query row ({total},)"
        raise bad_value("attn_scale", expected, f"shape {tuple(attn_scale.shape)}")
    if not attn_scale.dtype.is_floating_point:
        raise bad_type("attn_scale", "a floating dtype", attn_scale.dtype)
    if scaling > 0:
        raise ValueError(
            f"scaling_seqlen: expected the default -1 when attn_scale is given (it replaces scaling_seqlen), "
            f"got {scaling:g}"
        )


def _checked_bias(rel_bias, rab, q: torch.Tensor, batch: int, max_seq_len: int):
    if rel_bias is not None and rab is not None:
        raise ValueError("rab: expected None when rel_bias is given (give the bias one way), got a tensor")
    if rel_bias is not None:
        check_relative_bias(rel_bias, q)
        return rel_bias
    if rab is not None:
        check_rab(rab, q, batch, max_seq_len)
    return rab


def _probability(dropout_pr: object) -> float:
    if type(dropout_pr) is float and 0.0 <= dropout_pr < 1.0:  # the common case: as below, without the ABC check
        return dropout_pr
    if isinstance(dropout_pr, (bool, torch.Tensor)) or not isinstance(dropout_pr, numbers.Real):
        raise bad_type("dropout_pr", "a probability in [0, 1)", type(dropout_pr).__name__)
    p = float(dropout_pr)
    if not 0.0 <= p < 1.0:  # also rejects NaN
        raise bad_value("dropout_pr", "a probability in [0, 1)", dropout_pr)
    return p


def _check_values_on_host(seq_offsets, total: int, max_seq_len: int, num_targets: torch.Tensor | None) -> None:
    check_offsets_values(seq_offsets, total=total)
    check_lengths_at_most(seq_offsets, max_seq_len)
    if num_targets is not None:
        check_num_targets_values(num_targets, seq_offsets)


def _assert_values_on_device(seq_offsets, total: int, num_targets: torch.Tensor | None) -> None:
    """The host checks as device-side assertions: no sync and no graph break under torch.compile."""
    offs = seq_offsets.to(torch.int64)
    lengths = lengths_of(offs)
    torch._assert_async(offs[0] == 0, "seq_offsets[0]: expected 0 (asserted under torch.compile)")
    torch._assert_async(
        (lengths >= 0).all(), "seq_offsets: expected non-decreasing offsets (asserted under torch.compile)"
    )
    torch._assert_async(
        offs[-1] == total,
        "seq_offsets[-1]: expected the number of rows of the data, q.shape[0] (asserted under torch.compile)",
    )
    if num_targets is not None:
        nt = num_targets.to(torch.int64)
        torch._assert_async(
            ((nt >= 0) & (nt <= lengths)).all(),
            "num_targets: expected 0 <= T <= the sequence length (asserted under torch.compile)",
        )


def _choose_backend(kernel: Kernel | str, call: _Call) -> Kernel:
    if type(kernel) is not Kernel:  # Kernel(a member) is the member; the enum's call costs a microsecond
        try:
            kernel = Kernel(kernel)
        except ValueError:
            raise bad_value("kernel", f"one of {[k.value for k in Kernel]}", repr(kernel)) from None
    if kernel == Kernel.AUTO:
        reason = _triton_reason(call)
        return Kernel.TRITON if call.q.is_cuda and reason is None else Kernel.PYTORCH
    if kernel == Kernel.TRITON:
        reason = _triton_reason(call)
        if reason is not None:
            raise ValueError(f"{reason}; Kernel.PYTORCH runs every input")
    if kernel == Kernel.CUTLASS:
        raise RuntimeError(unavailable_reason())
    return kernel


def _triton_reason(c: _Call) -> str | None:
    return triton_unsupported_reason(c.q, c.v, c.mask, c.dropout_pr, attn_scale=c.attn_scale, bias=c.bias)


def _run_pytorch(c: _Call) -> torch.Tensor:
    return pytorch_hstu_mha(
        c.q,
        c.k,
        c.v,
        c.seq_offsets,
        c.mask,
        alpha=c.alpha,
        scaling_seqlen=c.scaling,
        max_seq_len=c.max_seq_len,
        dropout_pr=c.dropout_pr,
        attn_scale=c.attn_scale,
        bias=c.bias,
    )


_TRITON_ENTRY = []  # triton_hstu_mha, imported on first use (importing triton costs seconds)


def _run_triton(c: _Call) -> torch.Tensor:
    if not _TRITON_ENTRY:
        from .triton import triton_hstu_mha

        _TRITON_ENTRY.append(triton_hstu_mha)
    triton_hstu_mha = _TRITON_ENTRY[0]
    dense = isinstance(c.bias, torch.Tensor)
    common = dict(
        alpha=c.alpha,
        out_scale=1.0 / c.scaling,
        max_seq_len=c.max_seq_len,
        plan=c.plan,
        rel_bias=None if dense else c.bias,
        rab=c.bias if dense else None,
        plan_checked=True,  # _checked_call checked the plan, and the capability check the head dims
    )
    if c.attn_scale is not None:  # one float32 factor per row, as the kernels read it
        rows = c.attn_scale.to(torch.float32).expand(c.q.shape[0]).contiguous()
        common.update(out_scale=1.0, attn_scale=rows)
    if isinstance(c.mask, torch.Tensor):
        return triton_hstu_mha(c.q, c.k, c.v, c.seq_offsets, func=c.mask, **common)
    rule = c.mask
    if not rule.causal:  # plain by the capability check: every row sees its whole sequence
        if c.plan is not None and not torch.compiler.is_compiling():  # the plan's own all-visible func
            return triton_hstu_mha(c.q, c.k, c.v, c.seq_offsets, func=c.plan.func, **common)
        _, _, length = row_coords(c.seq_offsets, c.q.shape[0])
        return triton_hstu_mha(c.q, c.k, c.v, c.seq_offsets, func=length.to(torch.int32)[None, None], **common)
    plain = rule.num_targets is None and rule.max_attn_len == 0 and rule.contextual_seq_len == 0
    return triton_hstu_mha(
        c.q,
        c.k,
        c.v,
        c.seq_offsets,
        num_targets=rule.num_targets,
        causal_closed_form=plain,
        contextual=rule.contextual_seq_len,
        window=rule.max_attn_len,
        min_full=rule.min_full_attn_seq_len,
        **common,
    )


_BACKENDS = {Kernel.PYTORCH: _run_pytorch, Kernel.TRITON: _run_triton}
