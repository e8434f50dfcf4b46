from .hstu_mha import hstu_mha
from .kernel import Kernel

__all__ = ["Kernel", "hstu_mha"]
