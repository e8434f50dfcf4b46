"""e4m3 (``torch.float8_e4m3fn``) inputs for the delta forward (docs/design.md, section 8).

Each row and head of ``Q``, ``K`` and ``V`` carries its own float32 scale: ``x = x8 * scale``
with ``scale = max |x| / 448`` over the head's ``D`` values (``quantize_fp8``). A row's scale
never depends on another row, so a cached history and the rows appended to it are quantized
apart, with no shared scale to clip.

The kernel computes, per key tile of ``p_block`` columns (the tile's width: ``fp8_p_block``):

- ``s = alpha * (q8 . k8) * q_scale * k_scale`` in float32 (an e4m3 dot);
- ``x = silu(s) * v_scale``, zero where the mask hides the pair;
- ``x`` rounded to e4m3 after scaling each row by ``448 / max |x|`` over the tile's columns, the
  tile's product with ``v8`` (an e4m3 dot) scaled back.

The delta reference (``pytorch_delta_hstu_mha`` with ``fp8``) computes the same in PyTorch: under Triton's
interpreter the two agree up to float32 summation order; on a GPU the kernel's approximate sigmoid can also move
a value of P across an e4m3 rounding boundary. The e4m3 kernel needs a GPU of compute capability 8.9 or more
(Ada, Hopper).
"""

from __future__ import annotations

import os

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
    work = x.float()
    big = work.abs().amax(dim=2)
    # NaN and inf stay in the scale; the smallest normal float32 keeps rows of tiny values finite.
    scale = torch.where(big == 0, torch.ones_like(big), (big / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny))
    x8 = (work / scale[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, scale.contiguous()


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x8 * scale`` (``quantize_fp8``'s inverse, up to its rounding)."""
    return x8.float() * scale[:, :, None]


def fp8_p_block(dim_qk: int, dim_v: int) -> int:
    """The key tile width of the delta kernel for these head dims, where this process runs it (a GPU, or Triton's
    interpreter under ``TRITON_INTERPRET=1``): the tiles over which ``P`` is scaled to e4m3 (``round_p_tiles``)."""
    from .triton.config import tiles  # plain Python, no triton import
    from .triton.limits import tile_dim

    return tiles(tile_dim(dim_qk), tile_dim(dim_v), os.environ.get("TRITON_INTERPRET", "0") == "1").forward.block_n


def round_p_tiles(x: torch.Tensor, p_block: int) -> torch.Tensor:
    """``x (..., N)`` rounded as the kernel rounds ``P``: per row and tile of ``p_block`` columns (from column 0),
    scaled by ``448 / max |x|`` over the tile, rounded to e4m3 and scaled back. float32."""
    n = x.shape[-1]
    pad = -n % p_block
    tiles = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, p_block))
    big = tiles.abs().amax(dim=-1, keepdim=True)
    up = E4M3_MAX / big.clamp_min(1e-30)  # as the kernel: finite for a tile of zeros or of tiny values
    rounded = (tiles * up).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * (big / E4M3_MAX)
    return rounded.flatten(-2)[..., :n]
