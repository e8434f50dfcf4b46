"""e4m3 (``torch.float8_e4m3fn``) inputs for the delta forward (docs/design.md, section 8).

Each row and head of ``Q``, ``K`` and ``V`` carries its own float32 scale: ``x = x8 * scale``
with ``scale = max |x| / 448`` over the head's ``D`` values (``quantize_fp8``). A row's scale
never depends on another row, so a cached history and the rows appended to it are quantized
apart, with no shared scale to clip.

The attention is that of the dequantized values (``dequantize_fp8``); the delta reference computes it so. The
kernel computes, per key tile:

- ``s = alpha * (q8 . k8) * q_scale * k_scale`` in float32 (an e4m3 dot on the tensor cores);
- ``x = silu(s) * v_scale``, zero where the mask hides the pair;
- ``x @ v8`` with both in bfloat16, as the bfloat16 kernel computes ``P V``. An e4m3 product here (``x`` scaled
  per row to the e4m3 range and rounded) was twice as slow on an H100: the tensor cores read an e4m3 ``V`` only
  transposed, through shared memory.

The e4m3 kernel needs a GPU of compute capability 8.9 or more (Ada, Hopper).
"""

from __future__ import annotations

import torch

from .._errors import bad_type, bad_value

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite e4m3 value."""


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (rows, H, D)`` -> ``(x8, scale)``: e4m3 ``(rows, H, D)`` and float32 ``(rows, H)`` with ``x ~ x8 * scale``.

    Sync-free; computed in float32. A row and head of zeros gets scale 1. Values that are not finite in float32
    (float64 ones beyond its range included) give a non-finite scale, and the attention of the rows they reach
    is not finite either (as in bfloat16)."""
    if not isinstance(x, torch.Tensor):
        raise bad_type("x", "a torch.Tensor", type(x).__name__)
    if x.dim() != 3:
        raise bad_value("x", "a 3-D jagged tensor (rows, H, D)", f"shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == E4M3:
        raise bad_type("x.dtype", "float16, bfloat16, float32 or float64", x.dtype)
    if x.shape[2] == 0:
        raise bad_value("x.shape[2] (D)", "at least 1 value a row and head to scale", 0)
    work = x.float()
    big = work.abs().amax(dim=2)
    # NaN and inf stay in the scale; the smallest normal float32 keeps rows of tiny values finite.
    scale = torch.where(big == 0, torch.ones_like(big), (big / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny))
    x8 = (work / scale[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, scale.contiguous()


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x8 * scale`` (``quantize_fp8``'s inverse, up to its rounding): ``x8 (rows, H, D)``, ``scale
    (rows, H)``."""
    if not isinstance(x8, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise bad_type("x8, scale", "torch.Tensors", f"{type(x8).__name__}, {type(scale).__name__}")
    if x8.dim() != 3 or tuple(scale.shape) != tuple(x8.shape[:2]):
        raise bad_value(
            "scale.shape",
            f"x8.shape[:2] of a 3-D x8, {tuple(x8.shape[:2])}",
            f"{tuple(scale.shape)} for x8 of shape {tuple(x8.shape)}",
        )
    return x8.float() * scale[:, :, None]
