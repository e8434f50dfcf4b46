"""Adapter slot for an installed fbgemm HSTU wheel.

The func tensors built here use the fbgemm/CUTLASS layout, so they can be
handed to those kernels unchanged (as ``(H, NFUNC, total)`` with the wheel's
NFUNC). Calling the wheel through ``hstu_mha`` is not wired yet.
"""

from __future__ import annotations

import importlib.util


def unavailable_reason() -> str:
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return (
            "Kernel.CUTLASS needs the fbgemm_gpu HSTU wheel (pip install fbgemm_gpu_hstu), "
            "which is not installed; use Kernel.TRITON on CUDA or Kernel.PYTORCH"
        )
    return (
        "Kernel.CUTLASS: calling the fbgemm HSTU wheel through flexhstu.hstu_mha is not wired in this "
        "release; pass the func tensor to the wheel's own function, or use Kernel.TRITON"
    )
