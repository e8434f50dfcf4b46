"""Pictures of masks: one panel per sequence, query rows down, key columns across."""

from __future__ import annotations

import os

import torch
from PIL import Image, ImageDraw

VISIBLE = (31, 90, 160)
HIDDEN = (225, 228, 232)
PADDING = (255, 255, 255)
INK = (20, 20, 20)


def render(
    func: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    path: str,
    *,
    head: int = 0,
    cell: int = 0,
    title: str = "",
) -> str:
    """Draw ``func`` (head ``head``; a func of one head is every head's) for every sequence into a PNG at
    ``path``; returns the path.

    Colours: visible pairs dark blue, hidden pairs light grey, padding (past
    the sequence's length) white. ``cell=0`` picks a pixel size per cell that
    keeps each panel near 256 px.
    """
    from .._errors import as_int, bad_value
    from .format import to_dense

    head = as_int("head", head)
    cell = as_int("cell", cell)
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix not in Image.registered_extensions():
        raise bad_value("path", "a file name ending in an image extension such as .png", repr(str(path)))
    if isinstance(func, torch.Tensor) and func.dim() == 3 and func.shape[0] > 1 and head >= func.shape[0]:
        raise bad_value("head", f"a head of the func, 0 to {func.shape[0] - 1}", head)  # Hf = 1: every head's
    dense = to_dense(func, seq_offsets, max_seq_len)[:, min(head, func.shape[0] - 1)].cpu()
    lengths = (seq_offsets[1:] - seq_offsets[:-1]).tolist()
    n = max(int(max_seq_len), 1)
    cell = cell or max(1, 256 // n)
    side = n * cell
    margin, gap, top = 28, 24, 22 if title else 6
    width = margin + len(lengths) * (side + gap)
    height = top + side + margin + 14
    img = Image.new("RGB", (width, height), PADDING)
    draw = ImageDraw.Draw(img)
    if title:
        draw.text((margin, 4), title, fill=INK)
    for b, L in enumerate(lengths):
        x0 = margin + b * (side + gap)
        y0 = top + 14
        block = torch.zeros(n, n, dtype=torch.bool)  # n > max_seq_len when that is 0
        block[: dense.shape[-2], : dense.shape[-1]] = dense[b, :n, :n]
        rgb = torch.empty(n, n, 3, dtype=torch.uint8)
        inside = torch.zeros(n, n, dtype=torch.bool)
        inside[:L, :L] = True
        for colour, sel in ((PADDING, ~inside), (HIDDEN, inside & ~block), (VISIBLE, block)):
            rgb[sel] = torch.tensor(colour, dtype=torch.uint8)
        panel = Image.fromarray(rgb.numpy(), "RGB").resize((side, side), Image.NEAREST)
        img.paste(panel, (x0, y0))
        draw.rectangle([x0 - 1, y0 - 1, x0 + side, y0 + side], outline=INK)
        draw.text((x0, y0 - 13), f"seq {b}  L={L}   key ->", fill=INK)
        draw.text((x0, y0 + side + 3), "query: rows, top to bottom", fill=INK)
    img.save(path)
    return path
