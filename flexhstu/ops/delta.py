"""``delta_hstu_mha``: attention for new query rows against whole (cached) sequences. Forward only.

Checks follow ``hstu_mha``: nothing reads device memory of CUDA tensors; value
checks run on CPU tensors outside torch.compile, and under torch.compile they
become device-side assertions (not in ``torch.export`` programs: see the call).
"""

from __future__ import annotations

import torch

from .._errors import as_alpha, as_int, as_scaling, bad_type, bad_value
from ..jagged import (
    can_read_values,
    check_lengths_at_most,
    check_num_targets_values,
    check_offsets_meta,
    check_offsets_values,
    lengths_of,
)
from ..masks.rules import FixedRule
from .capability import triton_unsupported_reason
from .hstu_mha import _check_func_alone, _check_qkv, _check_same_device, _checked_rule
from .kernel import Kernel
from .plan import DeltaPlan
from .pytorch.delta_reference import pytorch_delta_hstu_mha

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def last_rows_offsets(seq_offsets: torch.Tensor, delta_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_offsets, q_start)`` for queries that are the last ``delta_size`` rows of every sequence.

    This is the generative-recommenders ``delta_hstu_mha`` convention (``delta_size =
    delta_q.shape[0] // B``): ``q_offsets = [0, d, 2d, ...]`` ``(B + 1,)`` and
    ``q_start = L_b - d`` ``(B,)``, int64 on the offsets' device. Sync-free.
    """
    check_offsets_meta(seq_offsets)
    delta_size = as_int("delta_size", delta_size)
    batch = seq_offsets.numel() - 1
    q_offsets = torch.arange(batch + 1, device=seq_offsets.device, dtype=torch.int64) * delta_size
    return q_offsets, lengths_of(seq_offsets) - delta_size


def delta_hstu_mha(
    max_seq_len: int,
    alpha: float | None,
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    kernel: Kernel = Kernel.AUTO,
    *,
    q_offsets: torch.Tensor | None = None,
    q_start: torch.Tensor | None = None,
    min_full_attn_seq_len: int = 0,
    attn_func: torch.Tensor | None = None,
    scaling_seqlen: int = -1,
    kv_lengths: torch.Tensor | None = None,
    delta_plan: DeltaPlan | None = None,
    fp8_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """HSTU attention for a subset of each sequence's rows (docs/design.md, section 9). Forward only.

    Every output row equals the same row of ``hstu_mha`` run on the whole
    sequences with the same mask and scale.

    - ``delta_q``: ``(total_q, H, Dqk)``, the query rows; ``k (total_kv, H, Dqk)``,
      ``v (total_kv, H, Dv)``: the whole sequences, jagged by ``seq_offsets (B + 1,)``.
      Returns ``(total_q, H, Dv)`` in the dtype of ``delta_q`` (bfloat16 with ``fp8_scales``).
    - ``q_offsets (B + 1,)`` jags ``delta_q``; ``q_start (B,)`` (integer) is the
      local position of each sequence's first query row: query ``r`` of sequence
      ``b`` is row ``q_start[b] + r`` of it, with ``0 <= q_start[b]`` and
      ``q_start[b] + (q_offsets[b + 1] - q_offsets[b]) <= L_b``. Give both or
      neither: neither means the generative-recommenders convention, the last
      ``delta_q.shape[0] // B`` rows of every sequence (:func:`last_rows_offsets`).
    - ``attn_func``: int32 ``(Hf, NFUNC, total_q)``, one column per query row, key
      columns sequence-local; alone decides visibility. Otherwise the causal fixed
      rule applies with ``num_targets``, ``max_attn_len``, ``contextual_seq_len``,
      ``min_full_attn_seq_len`` (exactly as in ``hstu_mha``).
    - ``max_seq_len``, ``alpha``, ``scaling_seqlen``: as in ``hstu_mha`` (the scale
      defaults to ``max_seq_len``, an upper bound on the whole sequences' lengths).
    - ``kernel``: ``Kernel.AUTO`` runs Triton on CUDA tensors it supports and the
      PyTorch reference otherwise.
    - ``kv_lengths (B,)`` (integer, optional): sequence ``b`` is only the first
      ``kv_lengths[b]`` rows of its slot ``seq_offsets[b] .. seq_offsets[b + 1]``
      (``L_b`` above), the rest of the slot is ignored. Serving keeps a buffer per
      layer with each history followed by room for new rows, and writes each
      micro-batch's rows there instead of copying the history every call.
    - ``delta_plan``: a ``flexhstu.DeltaPlan`` shared by the calls on the same
      ``seq_offsets`` and ``q_offsets`` tensors (the layers of a stack on one
      micro-batch): the first Triton call keeps the tables it makes from the
      offsets (three small launches) and the others reuse them. A call on other
      offsets tensors or rows, or after an in-place change that bumps their
      version counter, makes its own and keeps those instead. Use one plan per
      micro-batch, on one CUDA stream, and inside or outside a CUDA graph
      capture but not both: offsets changed in place without a version (made
      under ``torch.inference_mode``, written through ``.data`` or DLPack), a
      plan shared across streams, or one built eagerly and replayed in a graph
      would give the tables of other offsets. Without ``q_offsets`` each call
      makes new ones, and nothing is shared.
    - ``fp8_scales``: ``(q_scale, k_scale, v_scale)``, float32 ``(rows, H)`` each, for
      ``delta_q``, ``k``, ``v`` in ``torch.float8_e4m3fn`` (:func:`flexhstu.quantize_fp8`
      makes both): the attention of their dequantized values, ``Q K^T`` an e4m3 dot in the
      kernel, a bfloat16 output (``flexhstu.ops.fp8``).

    On CPU tensors (outside torch.compile) bad offsets, ``q_start`` or
    ``num_targets`` raise; on CUDA they are not read (no sync), and a query row
    whose position falls outside its sequence gets a zero output.

    Raises RuntimeError when a gradient could be asked for (grad mode on and an
    input requiring grad): the op has no backward.
    """
    _check_qkv(delta_q, k, v, q_name="delta_q", fp8=fp8_scales is not None)
    if fp8_scales is not None:
        fp8_scales = _checked_scales(fp8_scales, delta_q, k, v)
    _check_forward_only(delta_q, k, v, *(fp8_scales or ()))
    check_offsets_meta(seq_offsets)
    batch = seq_offsets.numel() - 1
    if (q_offsets is None) != (q_start is None):
        given, missing = ("q_offsets", "q_start") if q_start is None else ("q_start", "q_offsets")
        raise bad_value(missing, f"a tensor next to {given} (give both, or neither for the last rows)", None)
    last_rows = q_offsets is None
    if last_rows:
        if batch == 0 and delta_q.shape[0]:
            raise bad_value("delta_q.shape[0]", "0 (seq_offsets holds no sequence)", delta_q.shape[0])
        if batch and delta_q.shape[0] % batch:
            raise bad_value(
                "delta_q.shape[0]",
                f"a multiple of the batch size {batch} (last rows of each sequence)",
                delta_q.shape[0],
            )
        q_offsets, q_start = last_rows_offsets(seq_offsets, delta_q.shape[0] // max(batch, 1))
    _check_query_layout(q_offsets, q_start, batch)
    if kv_lengths is not None:
        _check_per_sequence(kv_lengths, "kv_lengths", batch, "rows used in each slot")
    if delta_plan is not None and not isinstance(delta_plan, DeltaPlan):
        raise bad_type("delta_plan", "None or a flexhstu.DeltaPlan", type(delta_plan).__name__)
    _check_same_device(
        delta_q,
        k=k,
        v=v,
        seq_offsets=seq_offsets,
        q_offsets=q_offsets,
        q_start=q_start,
        num_targets=num_targets,
        attn_func=attn_func,
        kv_lengths=kv_lengths,
        **({} if fp8_scales is None else dict(zip(("q_scale", "k_scale", "v_scale"), fp8_scales))),
    )
    max_seq_len = as_int("max_seq_len", max_seq_len)
    rule = _checked_rule(FixedRule(True, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len), batch)
    if attn_func is not None:
        _check_func_alone(attn_func, rule, delta_q)
    if can_read_values(seq_offsets):
        _check_values_on_host(
            seq_offsets,
            q_offsets,
            q_start,
            k.shape[0],
            delta_q.shape[0],
            max_seq_len,
            num_targets,
            kv_lengths,
            last_rows,
        )
    elif torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        # Not in exported programs: AOTInductor runs the graph's kernels on generated inputs while it compiles for
        # CUDA, and these assertions fired on them (H200, 2026-12-03). The exported serving scorer builds its
        # offsets itself (HistoryCache.gather, the micro-batch counts), so they hold what the assertions check.
        _assert_values_on_device(seq_offsets, q_offsets, q_start, k.shape[0], delta_q.shape[0], kv_lengths)
    alpha = as_alpha(alpha, delta_q.shape[2])
    scaling = as_scaling("scaling_seqlen", scaling_seqlen)
    if scaling <= 0:
        scaling = float(max_seq_len) or 1.0
    mask = attn_func if attn_func is not None else rule
    if _choose_backend(kernel, delta_q, v, mask) == Kernel.TRITON:
        return _run_triton(
            delta_q, k, v, seq_offsets, q_offsets, q_start, mask, alpha, scaling, kv_lengths, delta_plan, fp8_scales
        )
    if kv_lengths is not None:  # the reference reads the used rows, packed (one sync: it is the reference)
        seq_offsets, rows = _packed_rows(seq_offsets, kv_lengths)
        k, v = k[rows], v[rows]
        if fp8_scales is not None:
            fp8_scales = (fp8_scales[0], fp8_scales[1][rows], fp8_scales[2][rows])
    return pytorch_delta_hstu_mha(
        delta_q,
        k,
        v,
        seq_offsets,
        q_offsets,
        q_start,
        mask,
        alpha=alpha,
        scaling_seqlen=scaling,
        max_seq_len=max_seq_len,
        fp8=fp8_scales,
    )


def _packed_rows(seq_offsets: torch.Tensor, kv_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets of the sequences without their slots' unused rows, and those rows' indices in the slots."""
    lengths = torch.minimum(kv_lengths.to(torch.int64).clamp(min=0), lengths_of(seq_offsets).to(torch.int64))
    packed = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    rows = torch.arange(seq.numel(), device=lengths.device) - packed[seq] + seq_offsets.to(torch.int64)[seq]
    return packed, rows


def _check_per_sequence(x, name: str, batch: int, what: str) -> None:
    """``x``: a ``(batch,)`` integer tensor (``what`` it holds, for the message)."""
    if not isinstance(x, torch.Tensor):
        raise bad_type(name, f"a ({batch},) integer tensor", type(x).__name__)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise bad_type(name, f"an integer tensor ({what})", x.dtype)
    if x.dim() != 1 or x.numel() != batch:
        raise bad_value(name, f"a ({batch},) tensor", f"shape {tuple(x.shape)}")


def _checked_scales(scales, delta_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``fp8_scales``, each float32 ``(rows, H)`` of its input (the launch makes them contiguous)."""
    if not isinstance(scales, (tuple, list)) or len(scales) != 3:
        got = (
            f"{type(scales).__name__} of {len(scales)}" if isinstance(scales, (tuple, list)) else type(scales).__name__
        )
        raise bad_type("fp8_scales", "a tuple (q_scale, k_scale, v_scale) (flexhstu.quantize_fp8)", got)
    for name, s, x in zip(("q_scale", "k_scale", "v_scale"), scales, (delta_q, k, v)):
        if not isinstance(s, torch.Tensor):
            raise bad_type(f"fp8_scales {name}", "a float32 tensor", type(s).__name__)
        if s.dtype != torch.float32:
            raise bad_type(f"fp8_scales {name}.dtype", "torch.float32", s.dtype)
        if tuple(s.shape) != tuple(x.shape[:2]):
            raise bad_value(f"fp8_scales {name}", f"shape {tuple(x.shape[:2])} (rows, H) of its input", tuple(s.shape))
    return tuple(scales)


def _check_forward_only(*xs: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        names = [n for n, x in zip(("delta_q", "k", "v", "q_scale", "k_scale", "v_scale"), xs) if x.requires_grad]
        raise RuntimeError(
            "delta_hstu_mha is forward-only (inference); run it under torch.no_grad() or torch.inference_mode(), "
            f"or detach the inputs (requires_grad: {', '.join(names)}); hstu_mha has the backward"
        )


def _check_query_layout(q_offsets: torch.Tensor, q_start: torch.Tensor, batch: int) -> None:
    check_offsets_meta(q_offsets, "q_offsets")
    if q_offsets.numel() != batch + 1:
        raise bad_value(
            "q_offsets",
            f"B + 1 = {batch + 1} offsets (one sequence per seq_offsets entry)",
            f"shape {tuple(q_offsets.shape)}",
        )
    _check_per_sequence(q_start, "q_start", batch, "local positions")


def _check_values_on_host(
    seq_offsets,
    q_offsets,
    q_start,
    total_kv: int,
    total_q: int,
    max_seq_len: int,
    num_targets,
    kv_lengths=None,
    last_rows: bool = False,
) -> None:
    check_offsets_values(seq_offsets, total=total_kv)
    check_offsets_values(q_offsets, "q_offsets", total=total_q)
    if kv_lengths is not None:  # the used rows of each slot: from here on the sequences are those
        used, slot = kv_lengths.detach().to("cpu", torch.int64), lengths_of(seq_offsets).cpu()
        bad = (used < 0) | (used > slot)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0, 0])
            raise bad_value(
                f"kv_lengths[{b}]", f"0 <= kv_lengths <= the slot's rows {int(slot[b])} (seq_offsets)", int(used[b])
            )
        seq_offsets = torch.cat([used.new_zeros(1), used.cumsum(0)])
    check_lengths_at_most(seq_offsets, max_seq_len)
    length, nq = lengths_of(seq_offsets).cpu(), lengths_of(q_offsets).cpu()
    start = q_start.detach().to("cpu", torch.int64)
    bad = (start < 0) | (start + nq > length)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        if last_rows:  # q_start was derived: the caller gave delta_q alone
            raise bad_value(
                "delta_q.shape[0]",
                f"at most B * (the shortest sequence's rows) = {len(length)} * "
                f"{int(length.min())} (the last delta_q.shape[0] / B rows of every sequence; sequence {b} "
                f"has {int(length[b])})",
                total_q,
            )
        expected = f"0 <= q_start <= L - (query rows) = {int(length[b])} - {int(nq[b])} in sequence {b}"
        raise bad_value(f"q_start[{b}]", expected, int(start[b]))
    if num_targets is not None:
        check_num_targets_values(num_targets, seq_offsets)


def _assert_values_on_device(seq_offsets, q_offsets, q_start, total_kv: int, total_q: int, kv_lengths=None) -> None:
    """The host checks as device-side assertions: no sync and no graph break under torch.compile."""
    for name, offs, total in (("seq_offsets", seq_offsets, total_kv), ("q_offsets", q_offsets, total_q)):
        offs = offs.to(torch.int64)
        torch._assert_async(offs[0] == 0, f"{name}[0]: expected 0 (asserted under torch.compile)")
        torch._assert_async((lengths_of(offs) >= 0).all(), f"{name}: expected non-decreasing offsets (under compile)")
        torch._assert_async(offs[-1] == total, f"{name}[-1]: expected the rows of the data (under compile)")
    length = lengths_of(seq_offsets)
    if kv_lengths is not None:
        used = kv_lengths.to(torch.int64)
        torch._assert_async(
            ((used >= 0) & (used <= length)).all(),
            "kv_lengths: expected 0 <= kv_lengths <= the slots' rows (under compile)",
        )
        length = used
    start = q_start.to(torch.int64)
    fits = (start >= 0) & (start + lengths_of(q_offsets) <= length)
    torch._assert_async(fits.all(), "q_start: expected 0 <= q_start <= L - (query rows) (under compile)")


def _choose_backend(kernel: Kernel | str, delta_q: torch.Tensor, v: torch.Tensor, mask) -> Kernel:
    try:
        kernel = Kernel(kernel)
    except ValueError:
        raise bad_value("kernel", f"one of {[k.value for k in Kernel]}", repr(kernel)) from None
    if kernel == Kernel.CUTLASS:
        raise bad_value("kernel", "Kernel.AUTO, PYTORCH or TRITON for delta_hstu_mha (no CUTLASS delta kernel)", kernel)
    if kernel == Kernel.PYTORCH:
        return kernel
    reason = triton_unsupported_reason(delta_q, v, mask, 0.0)
    if kernel == Kernel.AUTO:
        return Kernel.TRITON if delta_q.is_cuda and reason is None else Kernel.PYTORCH
    if reason is not None:
        raise ValueError(f"{reason}; Kernel.PYTORCH runs every input")
    return kernel


def _run_triton(
    delta_q,
    k,
    v,
    seq_offsets,
    q_offsets,
    q_start,
    mask,
    alpha: float,
    scaling: float,
    kv_lengths=None,
    plan: DeltaPlan | None = None,
    fp8_scales: tuple | None = None,
) -> torch.Tensor:
    from .triton.delta_op import triton_delta_hstu_mha

    common = dict(alpha=alpha, out_scale=1.0 / scaling, kv_lengths=kv_lengths, plan=plan, fp8_scales=fp8_scales)
    if isinstance(mask, torch.Tensor):
        return triton_delta_hstu_mha(delta_q, k, v, seq_offsets, q_offsets, q_start, func=mask, **common)
    plain = mask.num_targets is None and mask.max_attn_len == 0 and mask.contextual_seq_len == 0
    return triton_delta_hstu_mha(
        delta_q,
        k,
        v,
        seq_offsets,
        q_offsets,
        q_start,
        num_targets=mask.num_targets,
        causal_closed_form=plain,
        contextual=mask.contextual_seq_len,
        window=mask.max_attn_len,
        min_full=mask.min_full_attn_seq_len,
        **common,
    )
