"""TorchEasyRec's ``hstu_mha``, ``delta_hstu_mha`` and ``build_sla_func_tensor`` (``tzrec.ops.hstu_attention``,
``tzrec.ops.hstu_attention_utils``), on flexhstu.

Same positional order, keywords and defaults as the peer. Where tzrec is more lenient than
``flexhstu.hstu_mha``, this module behaves as tzrec does:

- with ``attn_func`` given, ``causal``, ``num_targets``, ``max_attn_len``, ``contextual_seq_len`` and
  ``min_full_attn_seq_len`` are ignored (the func alone decides; flexhstu's strict API refuses them);
- ``num_targets`` larger than a sequence counts the whole sequence as targets
  (``torch.minimum(num_targets, lengths)``, on the device, without a sync);
- ``kernel`` takes tzrec's ``Kernel`` members or names: ``PYTORCH`` (the default, as in tzrec),
  ``TRITON``, ``CUTLASS``; ``"AUTO"`` picks Triton on CUDA where it can.

``sort_by_length`` and ``enable_tma`` are performance hints of tzrec's Triton kernels: accepted, no
effect. Unlike tzrec, ``attn_func`` runs on every backend (tzrec's Triton path refuses it) and its width
is any odd NFUNC, not only 3.

``delta_hstu_mha`` (serving: the last ``delta_q.shape[0] // B`` rows of every sequence as queries, against the
whole sequences' keys and values) runs ``flexhstu.delta_hstu_mha`` with tzrec's convention and leniencies:
``num_targets`` is clamped as above, ``scaling_seqlen=-1`` means ``max_seq_len``, and ``Kernel.CUTLASS``
runs Triton, as tzrec's own ``delta_hstu_mha`` does (there is no CUTLASS delta kernel).
"""

from __future__ import annotations

from enum import Enum

import torch

from .. import masks
from ..jagged import lengths_of
from ..ops import Kernel as _Kernel
from ..ops import hstu_mha as _hstu_mha
from ..ops.delta import delta_hstu_mha as _delta_hstu_mha
from ._kernels import to_kernel


class Kernel(Enum):
    """The members of tzrec's ``Kernel``, for callers that do not import TorchEasyRec."""

    TRITON = "TRITON"
    PYTORCH = "PYTORCH"
    CUTLASS = "CUTLASS"


def _clamped_targets(num_targets: torch.Tensor | None, seq_offsets: torch.Tensor) -> torch.Tensor | None:
    if not (isinstance(num_targets, torch.Tensor) and isinstance(seq_offsets, torch.Tensor)) or num_targets.shape != (
        seq_offsets.numel() - 1,
    ):
        return num_targets  # not a (B,) tensor: flexhstu's checks name the argument
    if num_targets.is_floating_point() or num_targets.dtype == torch.bool:
        return num_targets  # refused by flexhstu's checks, by name
    # In int64: a length cast to a small dtype (uint8, int8) wraps (256 -> 0) and would clamp the targets to it.
    return torch.minimum(num_targets.to(torch.int64), lengths_of(seq_offsets).to(num_targets.device, torch.int64))


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
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sort_by_length: bool = False,
    kernel: Enum | str = Kernel.PYTORCH,
    enable_tma: bool = False,
    attn_func: torch.Tensor | None = None,
    scaling_seqlen: int = -1,
) -> torch.Tensor:
    """HSTU attention with tzrec's signature: ``q, k (total, H, Dqk)``, ``v (total, H, Dv)`` -> ``(total, H, Dv)``.

    ``attn_func``: int32 ``(Hf, NFUNC, total)``, or None for the fixed rule. ``scaling_seqlen <= 0`` means
    ``max_seq_len``.
    """
    del sort_by_length, enable_tma  # hints for tzrec's Triton scheduling; flexhstu's kernels need neither
    kernel = to_kernel(kernel)
    if attn_func is not None:
        return _hstu_mha(
            max_seq_len,
            alpha,
            q,
            k,
            v,
            seq_offsets,
            dropout_pr=dropout_pr,
            training=training,
            attn_func=attn_func,
            scaling_seqlen=scaling_seqlen,
            kernel=kernel,
        )
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
        _clamped_targets(num_targets, seq_offsets),
        max_attn_len,
        contextual_seq_len,
        min_full_attn_seq_len,
        scaling_seqlen=scaling_seqlen,
        kernel=kernel,
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
    kernel: Enum | str = Kernel.PYTORCH,
    enable_tma: bool = False,
    scaling_seqlen: int = -1,
) -> torch.Tensor:
    """tzrec's cached attention: ``delta_q (B * d, H, Dqk)`` are the last ``d = delta_q.shape[0] // B`` rows of
    every sequence of ``k (total, H, Dqk)``, ``v (total, H, Dv)`` (jagged by ``seq_offsets (B + 1,)``) ->
    ``(B * d, H, Dv)``.

    Every output row equals the same row of ``hstu_mha`` on the whole sequences (the causal fixed rule with
    ``num_targets``, ``max_attn_len``, ``contextual_seq_len``; output scaled by ``1 / scaling_seqlen``,
    ``max_seq_len`` when ``scaling_seqlen <= 0``). Forward only.
    """
    del enable_tma  # a hint for tzrec's Triton kernel; flexhstu's needs none
    kernel = to_kernel(kernel)
    if kernel == _Kernel.CUTLASS:  # as tzrec's delta_hstu_mha: no CUTLASS delta kernel, Triton runs it
        kernel = _Kernel.TRITON
    return _delta_hstu_mha(
        max_seq_len,
        alpha,
        delta_q,
        k,
        v,
        seq_offsets,
        _clamped_targets(num_targets, seq_offsets),
        max_attn_len,
        contextual_seq_len,
        kernel=kernel,
        scaling_seqlen=scaling_seqlen,
    )


def build_sla_func_tensor(
    nheads: int,
    sla_k1: int,
    sla_k2: int,
    seq_offsets: torch.Tensor,
    total_q: int,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """tzrec's SLA func: ``masks.sla`` with ``nheads`` heads, int32 ``(nheads, 3, total_q)``.

    The same visible pairs as tzrec's builder (targets above a length are clamped to it, as there). The
    heads are a stride-0 ``expand`` of one row rather than a copy; call ``.contiguous()`` if a consumer
    needs dense memory. ``device``: where to build (default: the offsets' device).
    """
    if device is not None and isinstance(seq_offsets, torch.Tensor):
        seq_offsets = seq_offsets.to(device)
        num_targets = num_targets.to(device) if isinstance(num_targets, torch.Tensor) else num_targets
    return masks.sla(
        seq_offsets,
        sla_k1,
        sla_k2,
        num_targets=_clamped_targets(num_targets, seq_offsets),
        contextual_seq_len=contextual_seq_len,
        total=total_q,
        nheads=nheads,
    )
