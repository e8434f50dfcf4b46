"""flexhstu: HSTU attention under interval masks whose width is a run-time property."""

from . import masks
from .masks.format import HSTU_ARBITRARY_NFUNC
from .ops import Kernel, hstu_mha
from .ops.delta import delta_hstu_mha, last_rows_offsets

__version__ = "0.1.0"
__all__ = ["HSTU_ARBITRARY_NFUNC", "Kernel", "__version__", "delta_hstu_mha", "hstu_mha", "last_rows_offsets", "masks"]
