"""The reference: pad, decode the mask, silu, unpad. Autograd by torch.

This file defines what every backend computes (docs/design.md, section 4)::

    S = alpha * Q K^T [+ bias];  A = silu(S) * M / scaling_seqlen;  O = dropout(A) V

or, with ``attn_scale`` (docs/design.md, section 10), ``A = silu(S) * M * attn_scale[row]``. The
optional bias is a relative attention bias (``flexhstu.ops.bias``) or a dense ``rab (B, [H,] N, N)``.

Masking is by selection (``torch.where``), never by multiplication: a hidden or
padded entry contributes exactly 0 whatever it holds, so a NaN or Inf in one
sequence (or in a key a row does not see) cannot reach another row's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...jagged import lengths_of, row_coords
from ...masks.format import to_dense
from ...masks.rules import FixedRule, _dense_fixed
from ..bias import RelativeBias, dense_relative_bias

_HALF = (torch.float16, torch.bfloat16)


def pytorch_hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    mask: torch.Tensor | FixedRule,
    *,
    alpha: float,
    scaling_seqlen: float,
    max_seq_len: int,
    dropout_pr: float = 0.0,
    attn_scale: torch.Tensor | None = None,
    bias: RelativeBias | torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged ``q, k (total, H, Dqk)``, ``v (total, H, Dv)``, offsets ``(B + 1,)`` -> ``(total, H, Dv)``.

    ``mask``: a func ``(Hf, NFUNC, total)`` or the fixed rule's parameters.
    Sequences are padded to the longest one, which costs one read of the
    offsets (a sync on CUDA: this is the reference, not the hot path); under
    torch.compile that read would break the graph, so the padding is
    ``min(max_seq_len, total)`` and a longer sequence fails a device-side
    assertion. half and bfloat16 inputs are computed in float32 and the
    output cast back. ``dropout_pr`` is the rate to apply (0 outside training).
    ``attn_scale``: ``()`` or ``(total,)``, multiplies row ``t`` instead of dividing by
    ``scaling_seqlen``; autograd gives the backward (dO scaled the same way).
    ``bias``: added to ``alpha * Q K^T`` of the visible pairs, either the tables of a relative bias or a
    dense ``rab (B, N, N)`` / ``(B, 1 or H, N, N)`` with ``N = max_seq_len``; gradients reach it.
    """
    total, nheads, _ = q.shape
    if total == 0:  # keeps the output attached to the graph, so backward gives zero gradients
        inputs = [q, k, v, *_bias_tensors(bias)]
        return q.new_zeros(0, nheads, v.shape[2]) + 0.0 * sum(x.sum().to(q.dtype) for x in inputs)
    work = torch.float32 if q.dtype in _HALF else q.dtype
    offs = seq_offsets.to(torch.int64)
    n = _padded_length(offs, total, max_seq_len)
    pos = torch.arange(n, device=q.device)
    inside = pos[None, :] < lengths_of(offs)[:, None]  # (B, N)
    rows = (offs[:-1, None] + pos[None, :]).clamp(max=total - 1)
    qp, kp, vp = (torch.where(inside[:, :, None, None], x[rows].to(work), 0.0) for x in (q, k, v))  # (B, N, H, D)
    visible = _decode(mask, offs, n)  # (B, Hf, N, N)
    s = torch.einsum("bihd,bjhd->bhij", qp, kp) * alpha
    if bias is not None:
        s = s + _dense_bias(bias, offs, n).to(work)
    # Hidden scores become 0 before silu: silu(0) = 0, and where sends them no gradient. A score that
    # overflowed to -inf is raised to the lowest finite value, where silu is -0 rather than -inf * 0 = NaN.
    s = torch.where(visible, s.clamp(min=torch.finfo(s.dtype).min), 0.0)
    if attn_scale is None:
        a = F.silu(s) / scaling_seqlen
    else:
        scale = attn_scale.to(work)
        if scale.dim():  # one factor per query row: padded like q, (B, 1, N, 1)
            scale = torch.where(inside, scale[rows], 0.0)[:, None, :, None]
        a = F.silu(s) * scale
    if dropout_pr > 0.0:
        a = F.dropout(a, p=dropout_pr)
    o = torch.einsum("bhij,bjhd->bihd", a, vp)
    seq, i, _ = row_coords(offs, total)
    return o[seq, i].to(q.dtype)


def _decode(mask: torch.Tensor | FixedRule, offs: torch.Tensor, n: int) -> torch.Tensor:
    if isinstance(mask, torch.Tensor):
        return to_dense(mask, offs, n)
    return _dense_fixed(offs, n, mask)


def _bias_tensors(bias: RelativeBias | torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    if bias is None:
        return ()
    return (bias.pos_w, bias.ts_w) if isinstance(bias, RelativeBias) else (bias,)


def _dense_bias(bias: RelativeBias | torch.Tensor, offs: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, 1 or H, n, n)``: the pairs of the padded batch."""
    if isinstance(bias, RelativeBias):
        return dense_relative_bias(bias, offs, n)
    rab = bias if bias.dim() == 4 else bias[:, None]
    return rab[:, :, :n, :n]


def _padded_length(offs: torch.Tensor, total: int, max_seq_len: int) -> int:
    if torch.compiler.is_compiling():
        n = torch.sym_min(max_seq_len, total)
        torch._assert_async(
            (lengths_of(offs) <= n).all(), "max_seq_len: expected at least every sequence length (under torch.compile)"
        )
        return n
    return int(lengths_of(offs).max())
