"""What the Triton backend can run: one predicate for ``Kernel.AUTO`` and ``Kernel.TRITON``.

``Kernel.AUTO`` runs Triton on CUDA tensors when :func:`triton_unsupported_reason`
returns None and the PyTorch reference otherwise (its documented job); an
explicit ``Kernel.TRITON`` raises with the reason. Pure Python: importable
without triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..masks.rules import FixedRule
from .triton.limits import MAX_HEAD_DIM, MIN_HEAD_DIM, head_dim_supported

_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
"""Whether triton can be imported: looked up once, at import (a package lookup costs ~25 us per call, and a
plain constant is what torch.compile traces without a warning)."""


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def e4m3_reason(capability: tuple[int, int]) -> str | None:
    """Why a GPU of this compute capability cannot run the e4m3 kernel (Triton's e4m3 dots need sm_89 or later:
    Ada, Hopper), or None."""
    if tuple(capability) >= (8, 9):
        return None
    got = ".".join(map(str, capability))
    return f"q.dtype: expected a GPU of compute capability 8.9 or more for e4m3 Kernel.TRITON, got {got}"


def triton_unsupported_reason(
    q: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | FixedRule,
    dropout_pr: float,
    *,
    attn_scale: torch.Tensor | None = None,
    bias: object = None,
) -> str | None:
    """Why the Triton kernels cannot run this call, as ``arg: expected X, got Y``; None when they can.

    ``q (total, H, Dqk)``, ``v (total, H, Dv)``; ``mask`` is the func or the fixed
    rule's parameters; ``dropout_pr`` is the rate applied (0.0 outside training);
    ``attn_scale`` the output scale, ``()`` or ``(total,)``, or None; ``bias`` the attention bias
    (``rel_bias`` tables, which the kernels compute per tile, or a dense ``rab``, which they read per tile;
    both run), or None.
    """
    if not _TRITON_INSTALLED:
        return "kernel: expected a backend that is installed (Kernel.TRITON needs triton: pip install 'flexhstu[gpu]')"
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"q.device: expected CUDA for Kernel.TRITON (or the CPU under TRITON_INTERPRET=1), got {q.device}"
    if q.dtype == torch.float8_e4m3fn:  # delta_hstu_mha's fp8_scales
        reason = e4m3_reason(torch.cuda.get_device_capability(q.device)) if q.is_cuda else None
        if reason:
            return reason
    elif q.dtype not in TRITON_DTYPES:
        return f"q.dtype: expected float16, bfloat16 or float32 for Kernel.TRITON, got {q.dtype}"
    if q.dtype == torch.bfloat16 and not q.is_cuda:
        # Triton's interpreter computes tl.dot on bfloat16 tiles wrongly (outputs off by orders of magnitude).
        return (
            "q.dtype: expected float16 or float32 for Kernel.TRITON on the CPU (Triton's interpreter gets "
            "bfloat16 dots wrong; Kernel.PYTORCH runs it), got torch.bfloat16"
        )
    for name, d in (("q.shape[2] (Dqk)", q.shape[2]), ("v.shape[2] (Dv)", v.shape[2])):
        if not head_dim_supported(d):
            return f"{name}: expected a head dim from {MIN_HEAD_DIM} to {MAX_HEAD_DIM} for Kernel.TRITON, got {d}"
    if dropout_pr > 0.0:
        return f"dropout_pr: expected 0.0 (or training=False) for Kernel.TRITON, which has no dropout, got {dropout_pr}"
    if attn_scale is not None and attn_scale.requires_grad:
        return (
            "attn_scale: expected a tensor that does not require grad for Kernel.TRITON (the kernels give it no "
            "gradient; Kernel.PYTORCH does), got requires_grad=True"
        )
    if isinstance(mask, FixedRule) and not mask.causal:
        used = {
            "num_targets": mask.num_targets is not None,
            "max_attn_len": mask.max_attn_len > 0,
            "contextual_seq_len": mask.contextual_seq_len > 0,
        }
        extra = [name for name, on in used.items() if on]
        if extra:
            return (
                f"causal: expected True with {', '.join(extra)} for Kernel.TRITON (build the non-causal mask with "
                "flexhstu.masks or masks.from_dense and pass attn_func), got False"
            )
    return None
