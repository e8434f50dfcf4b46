"""The peers' kernel enums, translated to ``flexhstu.Kernel``."""

from __future__ import annotations

from enum import Enum

from .._errors import bad_value
from ..ops import Kernel

# Names of generative-recommenders' HammerKernel and TorchEasyRec's Kernel members (and ours), by backend.
_BY_NAME = {
    "AUTO": Kernel.AUTO,
    "PYTORCH": Kernel.PYTORCH,
    "TRITON": Kernel.TRITON,
    "TRITON_CC": Kernel.TRITON,  # GR's ahead-of-time compiled Triton: the same kernels here
    "TRITON_INFERENCE": Kernel.TRITON,
    "TLX": Kernel.TRITON,  # GR's Blackwell Triton variant
    "CUDA": Kernel.CUTLASS,  # GR's name for the fbgemm CUDA kernels
    "CUTLASS": Kernel.CUTLASS,
}


def to_kernel(kernel: object) -> Kernel:
    """``flexhstu.Kernel`` for a peer's enum member (by its ``.name``), its name or value string, or a Kernel."""
    if isinstance(kernel, Kernel):
        return kernel
    name = kernel.name if isinstance(kernel, Enum) else kernel
    if isinstance(name, str) and name.upper() in _BY_NAME:
        return _BY_NAME[name.upper()]
    raise bad_value("kernel", f"a kernel enum member or name, one of {sorted(_BY_NAME)}", repr(kernel))
