"""flexhstu: HSTU attention under interval masks whose width is a run-time property."""

from . import masks
from .masks.format import HSTU_ARBITRARY_NFUNC
from .ops import AttnPlan, DeltaPlan, Kernel, build_plan, hstu_mha
from .ops.delta import delta_hstu_mha, last_rows_offsets

__version__ = "0.1.0"
__all__ = [
    "HSTU_ARBITRARY_NFUNC",
    "AttnPlan",
    "DeltaPlan",
    "Kernel",
    "__version__",
    "build_plan",
    "delta_hstu_mha",
    "hstu_mha",
    "last_rows_offsets",
    "masks",
]
