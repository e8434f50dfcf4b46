"""Triton kernels: forward, backward (dQ query-major, dK/dV key-major), block plan from interval hulls.

``limits`` is plain Python; the kernels (and triton itself) are imported on first use of
``triton_hstu_mha``, so ``flexhstu.ops.capability`` can read the limits without triton installed.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "triton_hstu_mha":
        from .op import triton_hstu_mha

        return triton_hstu_mha
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["triton_hstu_mha"]
