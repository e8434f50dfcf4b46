from .hstu_mha import hstu_mha
from .kernel import Kernel
from .plan import AttnPlan, DeltaPlan, build_plan

__all__ = ["AttnPlan", "DeltaPlan", "Kernel", "build_plan", "hstu_mha"]
