"""generative-recommenders' ``hstu_mha`` and ``delta_hstu_mha`` (``generative_recommenders.ops.hstu_attention``),
on flexhstu.

Switch ``from generative_recommenders.ops.hstu_attention import hstu_mha, delta_hstu_mha`` to
``from flexhstu.compat.gr import hstu_mha, delta_hstu_mha``: same positional order (``attn_scale`` comes right
after ``num_targets`` in ``hstu_mha``, as in the peer), same keywords, same defaults. What differs:

- ``kernel`` takes GR's ``HammerKernel`` members (or their names): ``PYTORCH`` runs flexhstu's reference,
  ``TRITON`` / ``TRITON_CC`` / ``TLX`` its Triton kernels, ``CUDA`` the fbgemm wheel adapter. The default
  is ``PYTORCH``, as in the peer; ``"AUTO"`` picks Triton on CUDA where it can.
- ``sort_by_length`` and ``enable_tma`` are performance hints of GR's Triton kernels: accepted, no effect.
- ``causal=False`` runs (the peer asserts ``causal``).
- Inputs are checked as ``flexhstu.hstu_mha`` checks them (a sequence longer than ``max_seq_len`` on CPU,
  or ``num_targets`` above a length, is an error rather than a truncated answer).

``delta_hstu_mha`` (serving: the last ``delta_q.shape[0] // B`` rows of every sequence as queries, against
the whole sequences' keys and values) runs ``flexhstu.delta_hstu_mha`` with the peer's convention. Its
``kernel`` is read as above except ``CUDA``: the peer has no CUDA delta kernel and runs its PyTorch path for
it, and so does this. ``enable_tma`` has no effect.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..ops import Kernel
from ..ops import hstu_mha as _hstu_mha
from ..ops.delta import delta_hstu_mha as _delta_hstu_mha
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
        max_seq_len,
        alpha,
        q,
        k,
        v,
        seq_offsets,
        causal,
        dropout_pr,
        training,
        num_targets,
        max_attn_len,
        contextual_seq_len,
        min_full_attn_seq_len,
        attn_scale=attn_scale,
        kernel=to_kernel(kernel),
    )


def delta_hstu_mha(
    max_seq_len: int,
    alpha: float,
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    kernel: Enum | str = HammerKernel.PYTORCH,
    enable_tma: bool = False,
) -> torch.Tensor:
    """GR's cached attention: ``delta_q (B * d, H, Dqk)`` are the last ``d = delta_q.shape[0] // B`` rows of every
    sequence of ``k (total, H, Dqk)``, ``v (total, H, Dv)`` (jagged by ``seq_offsets (B + 1,)``) -> ``(B * d, H, Dv)``.

    Every output row equals the same row of ``hstu_mha`` on the whole sequences (the causal fixed rule with
    ``num_targets``, ``max_attn_len``, ``contextual_seq_len``; output scaled by ``1 / max_seq_len``). Forward only.
    """
    del enable_tma  # a hint for GR's Triton kernel; flexhstu's needs none
    kernel = to_kernel(kernel)
    if kernel == Kernel.CUTLASS:  # GR's HammerKernel.CUDA: the peer's delta dispatch runs its PyTorch path
        kernel = Kernel.PYTORCH
    return _delta_hstu_mha(
        max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets, max_attn_len, contextual_seq_len, kernel=kernel
    )
