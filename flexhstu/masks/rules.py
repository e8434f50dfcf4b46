"""Dense forms of the rules, elementwise as the HSTU reference implementations write them.

These define the semantics the interval builders compress; the PyTorch
reference decodes with them when ``hstu_mha`` gets ``attn_func=None``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class FixedRule(NamedTuple):
    """The fixed rule's parameters (docs/design.md, section 3), as ``hstu_mha`` takes them."""

    causal: bool = True
    num_targets: torch.Tensor | None = None
    max_attn_len: int = 0
    contextual_seq_len: int = 0
    min_full_attn_seq_len: int = 0


def dense_fixed(
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    *,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
) -> torch.Tensor:
    """The HSTU valid-mask rule as bool ``(B, 1, N, N)``; padding rows/columns False.

    ``causal=False`` uses ``|ids(i) - ids(j)|`` for the distance, as the
    reference implementations do. Every argument is checked (the offsets' and num_targets' values are read).
    """
    from .._errors import as_bool, as_int, as_span, bad_value
    from ..jagged import check_num_targets_meta, check_num_targets_values, check_offsets_meta, check_offsets_values

    check_offsets_meta(seq_offsets)
    check_offsets_values(seq_offsets)
    n = as_int("max_seq_len", max_seq_len)
    longest = int((seq_offsets[1:] - seq_offsets[:-1]).max()) if seq_offsets.numel() > 1 else 0
    if n < longest:
        raise bad_value("max_seq_len", f"at least every sequence length (the longest has {longest})", n)
    if num_targets is not None:
        check_num_targets_meta(num_targets, seq_offsets.numel() - 1)
        check_num_targets_values(num_targets, seq_offsets)
    rule = FixedRule(
        as_bool("causal", causal),
        num_targets,
        as_span("max_attn_len", max_attn_len),
        as_span("contextual_seq_len", contextual_seq_len),
        as_span("min_full_attn_seq_len", min_full_attn_seq_len),
    )
    return _dense_fixed(seq_offsets, n, rule)


def _dense_fixed(seq_offsets: torch.Tensor, max_seq_len: int, rule: FixedRule) -> torch.Tensor:
    """``dense_fixed`` of checked arguments (the references call it after ``hstu_mha``'s checks)."""
    causal, num_targets, max_attn_len, c, min_full_attn_seq_len = rule
    offs = seq_offsets.to(torch.int64)
    n = int(max_seq_len)
    lengths = offs[1:] - offs[:-1]
    pos = torch.arange(n, device=offs.device)
    L = lengths[:, None]
    x = pos[None, :].expand(lengths.numel(), n)
    ids = (x - c + 1).clamp(min=0) if c > 0 else x
    max_id = L - (c - 1 if c > 0 else 0)
    if num_targets is not None:
        max_id = max_id - num_targets.to(device=offs.device, dtype=torch.int64)[:, None]
        ids = torch.minimum(ids, max_id)
    ii = ids[:, :, None]
    jj = ids[:, None, :]
    d = ii - jj
    if not causal:
        d = d.abs()
    eye = torch.eye(n, dtype=torch.bool, device=offs.device)[None]
    valid = eye | (d > 0)
    if max_attn_len > 0:
        keep = d <= max_attn_len
        if min_full_attn_seq_len > 0:
            keep = keep | (ii >= (max_id - min_full_attn_seq_len)[:, :, None])
        valid = valid & keep
    if c > 0:
        valid = valid | ((ii == 0) & (jj < max_id[:, :, None]))
    inside = pos[None, :] < L
    valid = valid & inside[:, :, None] & inside[:, None, :]
    return valid[:, None]
