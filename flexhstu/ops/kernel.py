from enum import Enum


class Kernel(str, Enum):
    """Backend choice for ``hstu_mha``. AUTO: TRITON on CUDA when Triton is installed, else PYTORCH."""

    AUTO = "auto"
    PYTORCH = "pytorch"
    TRITON = "triton"
    CUTLASS = "cutlass"
