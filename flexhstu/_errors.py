"""One shape for every input error: the argument, what was expected, what was given."""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch


def bad_value(arg: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {got}")


def bad_type(arg: str, expected: str, got: object) -> TypeError:
    return TypeError(f"{arg}: expected {expected}, got {got}")


def as_int(arg: str, value: object, minimum: int = 0) -> int:
    """``value`` as a Python int ``>= minimum``.

    Accepts anything ``operator.index`` takes (int, numpy integers) except bool
    and tensors: a tensor would need a device read, so the caller says ``int(t)``.
    Symbolic ints (under torch.compile) pass through unchanged.
    """
    if type(value) is int and value >= minimum:  # the common case, first: every call checks a few
        return value
    expected = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, (bool, torch.Tensor)):
        raise bad_type(arg, f"{expected} (not a {type(value).__name__})", value)
    try:
        out = operator.index(value)
    except TypeError:
        raise bad_type(arg, expected, type(value).__name__) from None
    if out < minimum:
        raise bad_value(arg, expected, out)
    return out


FLOAT32_MAX = float(np.finfo(np.float32).max)


def as_alpha(value: object, dim_qk: int) -> float:
    """The score scale: ``1 / sqrt(dim_qk)`` for None, else a finite number that float32 holds (the kernels
    scale in float32: a larger one became inf, and every score NaN)."""
    if value is None:
        if dim_qk == 0:
            raise bad_value("alpha", "a number when the head dim Dqk is 0 (None means 1 / sqrt(Dqk))", None)
        return dim_qk**-0.5
    out = as_finite("alpha", value)
    if abs(out) > FLOAT32_MAX:
        raise bad_value("alpha", f"a number float32 holds (|alpha| <= {FLOAT32_MAX:.4g})", out)
    return out


SPAN_MAX = 1 << 30
"""Above every sequence position (the kernels' int32 positions stay below it, and so do sums of two of them)."""


def as_span(arg: str, value: object, minimum: int = 0) -> int:
    """A mask length (window, contextual prefix, full-attention tail) as ``as_int`` (``>= minimum``), capped at
    ``SPAN_MAX``: a span at least as long as every sequence means the same at any size, and a larger int would wrap
    in the int32 arithmetic of the masks and kernels (``contextual_seq_len=2**31`` would wrap to the plain causal
    mask)."""
    out = as_int(arg, value, minimum)
    return torch.sym_min(out, SPAN_MAX) if isinstance(out, torch.SymInt) else min(out, SPAN_MAX)


SCALING_RANGE = (1e-37, 1e37)
"""Positive ``scaling_seqlen`` values whose reciprocal (the kernels' float32 output scale) is a normal float32."""


def as_scaling(arg: str, value: object) -> float:
    """``value`` as a finite float that is ``<= 0`` (the default) or a positive scale inside ``SCALING_RANGE``:
    a tiny scale's reciprocal overflows float32 to inf (outputs NaN), a huge one's is subnormal or 0."""
    out = as_finite(arg, value)
    lo, hi = SCALING_RANGE
    if out > 0 and not lo <= out <= hi:
        raise bad_value(
            arg,
            f"<= 0 (the default) or a scale from {lo:g} to {hi:g} (its reciprocal scales the output in float32)",
            f"{out:g}",
        )
    return out


def as_bool(arg: str, value: object) -> bool:
    """``value`` (a Python or NumPy bool) as a bool; anything else (``"no"``, None, 0) is refused: a truth test
    would read ``"no"`` as True."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise bad_type(arg, "a bool (Python or NumPy)", type(value).__name__)


def as_finite(arg: str, value: object) -> float:
    """``value`` (a real number, not bool or tensor) as a finite Python float."""
    t = type(value)
    if t is float or t is int:  # the common cases, without the ABC check below (a non-finite one raises there)
        out = float(value)
        if math.isfinite(out):
            return out
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
        raise bad_type(arg, "a real number", type(value).__name__)
    out = float(value)
    if not math.isfinite(out):
        raise bad_value(arg, "a finite number", out)
    return out
