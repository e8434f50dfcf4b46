"""The delta reference: attention for a subset of query rows against whole sequences (docs/design.md, section 9).

Pad, decode, silu, unpad, as the full reference does; only the query side differs.
Query ``r`` of sequence ``b`` (jagged row ``q_offsets[b] + r``) sits at local
position ``i = q_start[b] + r`` and sees what row ``i`` of a full call sees, so its
output equals that row of the full call. A query whose position falls outside
``[0, L_b)`` sees nothing (output 0): the public op rejects it on CPU, and on CUDA
(where it is not checked) the answer stays defined.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...jagged import lengths_of, row_coords
from ...masks.rules import FixedRule, _dense_fixed


def pytorch_delta_hstu_mha(
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    q_offsets: torch.Tensor,
    q_start: torch.Tensor,
    mask: torch.Tensor | FixedRule,
    *,
    alpha: float,
    scaling_seqlen: float,
    max_seq_len: int,
    fp8: tuple | None = None,
) -> torch.Tensor:
    """``delta_q (total_q, H, Dqk)``, ``k (total_kv, H, Dqk)``, ``v (total_kv, H, Dv)`` -> ``(total_q, H, Dv)``.

    ``seq_offsets (B + 1,)`` jag k and v; ``q_offsets (B + 1,)`` jag delta_q;
    ``q_start (B,)`` is the local position of each sequence's first query row.
    ``mask``: a func ``(Hf, NFUNC, total_q)`` (one column per query row, key
    columns sequence-local) or the fixed rule's parameters (applied to the whole
    sequence, then read at the query rows). Padding reads the offsets (a sync on
    CUDA; this is the reference). half and bfloat16 are computed in float32.
    ``fp8``: ``(q_scale, k_scale, v_scale)`` for e4m3 inputs: the attention of
    their dequantized values (``flexhstu.ops.fp8``), the output bfloat16.
    """
    total_q, nheads, _ = delta_q.shape
    total_kv = k.shape[0]
    if total_q == 0 or total_kv == 0:  # no keys: every query sees nothing
        return delta_q.new_zeros(total_q, nheads, v.shape[2], dtype=torch.bfloat16 if fp8 else delta_q.dtype)
    work = delta_q.dtype if delta_q.dtype in (torch.float32, torch.float64) else torch.float32
    out_dtype = delta_q.dtype if fp8 is None else torch.bfloat16
    if fp8 is not None:  # the e4m3 values times their rows' scales (flexhstu.dequantize_fp8)
        delta_q, k, v = (x.float() * scale[:, :, None] for x, scale in zip((delta_q, k, v), fp8))
    offs, qoffs = seq_offsets.to(torch.int64), q_offsets.to(torch.int64)
    length, nq = lengths_of(offs), lengths_of(qoffs)
    n = _padded_length(length, total_kv, max_seq_len)
    m = _padded_length(nq, total_q, max_seq_len)
    kpos, qpos = torch.arange(n, device=k.device), torch.arange(m, device=k.device)
    key_in = kpos[None, :] < length[:, None]  # (B, N)
    query_in = qpos[None, :] < nq[:, None]  # (B, M)
    krows = (offs[:-1, None] + kpos[None, :]).clamp(max=total_kv - 1)
    qrows = (qoffs[:-1, None] + qpos[None, :]).clamp(max=total_q - 1)
    kp, vp = (torch.where(key_in[:, :, None, None], x[krows].to(work), 0.0) for x in (k, v))  # (B, N, H, D)
    qp = torch.where(query_in[:, :, None, None], delta_q[qrows].to(work), 0.0)  # (B, M, H, Dqk)
    pos = q_start.to(device=k.device, dtype=torch.int64)[:, None] + qpos[None, :]  # (B, M) local positions
    row_ok = query_in & (pos >= 0) & (pos < length[:, None])
    visible = _decode(mask, offs, qrows, pos, n) & row_ok[:, None, :, None] & key_in[:, None, None, :]  # (B, Hf, M, N)
    s = torch.where(visible, torch.einsum("bihd,bjhd->bhij", qp, kp) * alpha, 0.0)
    o = torch.einsum("bhij,bjhd->bihd", F.silu(s) / scaling_seqlen, vp)
    seq, r, _ = row_coords(qoffs, total_q)
    return o[seq, r].to(out_dtype)


def _decode(
    mask: torch.Tensor | FixedRule, offs: torch.Tensor, qrows: torch.Tensor, pos: torch.Tensor, n: int
) -> torch.Tensor:
    """bool ``(B, Hf, M, N)``: which key columns each padded query row's intervals (or the fixed rule) cover."""
    cols = torch.arange(n, device=offs.device)
    if isinstance(mask, torch.Tensor):
        f = mask[:, :, qrows].permute(2, 0, 3, 1).to(torch.int64)  # (B, Hf, M, NFUNC)
        cols = cols.view(1, 1, 1, n)
        vis = cols < f[..., 0:1]
        for j in range(1, (mask.shape[1] + 1) // 2):
            vis = vis | ((cols >= f[..., 2 * j - 1 : 2 * j]) & (cols < f[..., 2 * j : 2 * j + 1]))
        return vis
    full = _dense_fixed(offs, n, mask)  # (B, 1, N, N): the rule over whole sequences
    batch = torch.arange(offs.numel() - 1, device=offs.device)[:, None]
    return full[batch, 0, pos.clamp(0, n - 1)][:, None]  # out-of-range rows are cut by the caller


def _padded_length(lengths: torch.Tensor, total: int, max_seq_len: int) -> int:
    if torch.compiler.is_compiling():
        n = torch.sym_min(max_seq_len, total)
        torch._assert_async((lengths <= n).all(), "max_seq_len: expected at least every length (under compile)")
        return n
    return max(int(lengths.max()), 1)
