"""Triton kernels: forward, backward (dQ query-major, dK/dV key-major), block plan from interval hulls."""

from .op import triton_hstu_mha

__all__ = ["triton_hstu_mha"]
