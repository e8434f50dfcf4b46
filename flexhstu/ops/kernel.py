from enum import Enum


class Kernel(str, Enum):
    """Backend choice for ``hstu_mha``.

    AUTO: TRITON for CUDA tensors that ``ops.capability.triton_unsupported_reason``
    accepts, PYTORCH otherwise. An explicit TRITON or CUTLASS that cannot run
    the call raises, saying why.
    """

    AUTO = "auto"
    PYTORCH = "pytorch"
    TRITON = "triton"
    CUTLASS = "cutlass"
