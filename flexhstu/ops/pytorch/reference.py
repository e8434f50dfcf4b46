"""The reference: pad, decode the mask, silu, unpad. Autograd by torch.

This file defines what every backend computes (DESIGN.md section 4)::

    S = alpha * Q K^T;  A = silu(S) * M / scaling_seqlen;  O = dropout(A) V
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...jagged import row_coords


def pytorch_hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    mask: torch.Tensor,
    scaling_seqlen: float,
    dropout_pr: float = 0.0,
    training: bool = True,
) -> torch.Tensor:
    """Jagged ``q, k (total, H, Dqk)``, ``v (total, H, Dv)``, bool ``mask (B, Hf, N, N)`` -> ``(total, H, Dv)``."""
    total, nheads, _ = q.shape
    n = int(max_seq_len)
    if total == 0 or n == 0:
        return q.new_zeros(total, nheads, v.shape[2]) + 0.0 * (q.sum() + k.sum() + v.sum())
    offs = seq_offsets.to(torch.int64)
    pos = torch.arange(n, device=q.device)
    lengths = offs[1:] - offs[:-1]
    valid = pos[None, :] < lengths[:, None]
    rows = (offs[:-1, None] + pos[None, :]).clamp(max=total - 1)
    keep = valid[:, :, None, None].to(q.dtype)
    qp, kp, vp = (x[rows] * keep for x in (q, k, v))  # (B, N, H, D)
    s = torch.einsum("bihd,bjhd->bhij", qp, kp) * alpha
    a = F.silu(s) * mask.to(s.dtype) / scaling_seqlen
    if dropout_pr > 0.0:
        a = F.dropout(a, p=dropout_pr, training=training)
    o = torch.einsum("bhij,bjhd->bihd", a, vp)
    seq, i, _ = row_coords(seq_offsets, total)
    return o[seq, i]
