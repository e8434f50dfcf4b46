"""The sigmoid of SiLU, one MUFU instruction on the GPU, and the scores it is taken of."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sigmoid(x, FAST_SIGMOID: tl.constexpr):
    """sigmoid(x). FAST_SIGMOID: one MUFU op, ``0.5 + 0.5 tanh(x / 2)`` with tanh.approx.f32 (relative
    error ~5e-4, far under bf16's); else ``1 / (1 + 2^(-x log2 e))`` (the interpreter has no inline PTX)."""
    if FAST_SIGMOID:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x * 0.5], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return 0.5 + 0.5 * t
    else:
        return 1.0 / (1.0 + tl.exp2(-x * 1.4426950408889634))


@triton.jit
def finite_below(s):
    """``s`` with -inf raised to float32's lowest finite value; NaN stays NaN.

    A score that overflows to -inf (a huge ``alpha`` or huge q, k) has silu 0 in exact arithmetic, but
    ``-inf * sigmoid(-inf)`` is NaN; at the lowest finite value the product is -0. One min/max per score,
    compiled in only where ``|alpha| > 1`` (FLOOR_SCORES, ``launch._attention_args``).
    """
    return tl.maximum(s, -3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)
