from .hstu_mha import hstu_mha
from .kernel import Kernel
from .plan import AttnPlan, build_plan

__all__ = ["AttnPlan", "Kernel", "build_plan", "hstu_mha"]
