"""generative-recommenders' ``hstu_mha`` (``generative_recommenders.ops.hstu_attention``), on flexhstu.

Switch ``from generative_recommenders.ops.hstu_attention import hstu_mha`` to
``from flexhstu.compat.gr import hstu_mha``: same positional order (``attn_scale`` comes right after
``num_targets``, as in the peer), same keywords, same defaults. What differs:

- ``kernel`` takes GR's ``HammerKernel`` members (or their names): ``PYTORCH`` runs flexhstu's reference,
  ``TRITON`` / ``TRITON_CC`` / ``TLX`` its Triton kernels, ``CUDA`` the fbgemm wheel adapter. The default
  is ``PYTORCH``, as in the peer; ``"AUTO"`` picks Triton on CUDA where it can.
- ``sort_by_length`` and ``enable_tma`` are performance hints of GR's Triton kernels: accepted, no effect.
- ``causal=False`` runs (the peer asserts ``causal``).
- Inputs are checked as ``flexhstu.hstu_mha`` checks them (a sequence longer than ``max_seq_len`` on CPU,
  or ``num_targets`` above a length, is an error rather than a truncated answer).

``delta_hstu_mha`` (serving) is not offered here yet.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..ops import hstu_mha as _hstu_mha
from ._kernels import to_kernel


class HammerKernel(Enum):
    """The members of GR's ``HammerKernel``, for callers that do not import generative-recommenders."""

    TRITON = "TRITON"
    PYTORCH = "PYTORCH"
    CUDA = "CUDA"
    TRITON_CC = "TRITON_CC"


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: torch.Tensor | None = None,
    attn_scale: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sort_by_length: bool = False,
    kernel: Enum | str = HammerKernel.PYTORCH,
    enable_tma: bool = False,
) -> torch.Tensor:
    """HSTU attention with GR's signature: ``q, k (total, H, Dqk)``, ``v (total, H, Dv)`` -> ``(total, H, Dv)``.

    The fixed rule (causal, targets, contextual prefix, window); output scaled by ``1 / max_seq_len``, or
    by ``attn_scale`` (``()`` or ``(total,)``, one factor per query row) when given.
    """
    del sort_by_length, enable_tma  # hints for GR's Triton scheduling; flexhstu's kernels need neither
    return _hstu_mha(
        max_seq_len, alpha, q, k, v, seq_offsets, causal, dropout_pr, training, num_targets, max_attn_len,
        contextual_seq_len, min_full_attn_seq_len, attn_scale=attn_scale, kernel=to_kernel(kernel),
    )
