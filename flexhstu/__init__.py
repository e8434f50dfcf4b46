"""flexhstu: HSTU attention under interval masks whose width is a run-time property."""

from . import masks
from .masks.format import HSTU_ARBITRARY_NFUNC
from .ops import Kernel, hstu_mha

__version__ = "0.1.0"
__all__ = ["HSTU_ARBITRARY_NFUNC", "Kernel", "__version__", "hstu_mha", "masks"]
