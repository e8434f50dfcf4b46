"""What the kernels take, grouped: a tensor with its strides, the func, the fixed rule.

Triton passes a NamedTuple to a ``@triton.jit`` function field by field (each
field specialised like a plain argument), so a kernel reads ``q.stride_t``
instead of taking ``stride_qt`` among forty positional arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Jagged(NamedTuple):
    """A jagged ``(total, H, D)`` tensor with a unit last stride: element ``(t, h, d)`` is at
    ``ptr + t * stride_t + h * stride_h + d``."""

    ptr: torch.Tensor
    stride_t: int
    stride_h: int


class Func(NamedTuple):
    """The func tensor ``(Hf, NFUNC, total)``; ``stride_h`` is 0 when one mask row serves every head."""

    ptr: torch.Tensor
    stride_h: int
    stride_j: int
    stride_t: int


class RuleArgs(NamedTuple):
    """The kernels' ``rule`` argument: the fixed rule's parameters (docs/design.md, section 3; the caller's
    form is ``flexhstu.masks.rules.FixedRule``): ``num_targets`` ``(B,)`` (read only when the kernel's
    HAS_TARGETS is set), ``contextual_seq_len``, ``max_attn_len``, ``min_full_attn_seq_len``."""

    num_targets: torch.Tensor
    contextual: int
    window: int
    min_full: int


class Fp8Scales(NamedTuple):
    """The per-(row, head) float32 scales of e4m3 ``Q``, ``K``, ``V`` (``flexhstu.ops.fp8``): row ``t``, head ``h`` of
    each at ``ptr + t * stride_t + h``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    stride_t: int


_new_tuple = tuple.__new__


def jagged(x: torch.Tensor) -> Jagged:
    """``Jagged(x, x.stride(0), x.stride(1))``, made with one ``stride()`` call and without the NamedTuple's Python
    ``__new__`` (a launch makes several: 0.63 us each against 0.26 on the CPU emulation)."""
    s = x.stride()
    return _new_tuple(Jagged, (x, s[0], s[1]))
