from .reference import pytorch_hstu_mha

__all__ = ["pytorch_hstu_mha"]
