"""flexhstu: HSTU attention under interval masks whose width is a run-time property."""

from . import masks
from .masks.format import HSTU_ARBITRARY_NFUNC
from .ops import AttnPlan, DeltaPlan, Kernel, build_plan, hstu_mha
from .ops.delta import delta_hstu_mha, last_rows_offsets
from .ops.fp8 import dequantize_fp8, quantize_fp8

__version__ = "0.1.0"
__all__ = [
    "HSTU_ARBITRARY_NFUNC",
    "AttnPlan",
    "DeltaPlan",
    "Kernel",
    "__version__",
    "build_plan",
    "delta_hstu_mha",
    "dequantize_fp8",
    "hstu_mha",
    "last_rows_offsets",
    "masks",
    "quantize_fp8",
]
