"""Block plans built once per batch and shared by every attention call on it (docs/design.md, section 8).

    plan = build_plan(seq_offsets, total=total, max_seq_len=n, attn_func=func)
    for layer in layers:                  # forward and backward of every layer reuse the plan
        out = triton_hstu_mha(q, k, v, seq_offsets, func=func, ..., plan=plan)

A plan depends on the offsets and the mask, never on q, k, v: it holds the block tables and, per
dK/dV tile (which follows the head dims), the key-major plan, built on first use on the GPU with no
host-device sync, so building and using it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .._errors import as_int, bad_type, bad_value
from ..jagged import can_read_values, row_coords
from ..masks.format import check_func_meta, check_offsets_meta, validate
from .triton.block_plan import BlockPlan, Visibility
from .triton.op import visibility


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same storage, shape and strides (host metadata only: no device read)."""
    if a is None or b is None:
        return a is b
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device and a.dtype == b.dtype)


def _describe(vis: Visibility) -> str:
    kind = {0: "func", 1: "causal", 2: "fixed rule"}[vis.mode]
    if vis.mode == 0:
        kind += f" of shape {tuple(vis.func.shape)} at {vis.func.data_ptr():#x}"
    if vis.mode == 2:
        nt = "none" if vis.num_targets is None else f"at {vis.num_targets.data_ptr():#x}"
        kind += f" (num_targets {nt}, contextual {vis.contextual}, window {vis.window}, min_full {vis.min_full})"
    return kind


class AttnPlan:
    """The block plan of one batch and one mask; see ``build_plan``.

    ``func``: the func the kernels read (``(Hf, NFUNC, total)`` int32), or None for the closed-form
    causal and fixed rules; pass it as ``func=`` to calls with this plan (for ``causal=False`` it is
    the plan's own all-visible func).
    """

    def __init__(self, seq_offsets: torch.Tensor, total: int, max_seq_len: int, vis: Visibility):
        self.seq_offsets, self.total, self.max_seq_len = seq_offsets, total, max_seq_len
        self.block = BlockPlan(seq_offsets.to(torch.int64).contiguous(), total, vis)

    @property
    def func(self) -> torch.Tensor | None:
        return self.block.vis.func

    def check_call(self, seq_offsets: torch.Tensor, total: int, vis: Visibility) -> None:
        """Raise unless a call with these offsets, ``total`` rows and mask is the one this plan was built for."""
        if not _same_tensor(seq_offsets, self.seq_offsets):
            raise bad_value("plan", "a plan built from this call's seq_offsets tensor (same storage and shape)",
                            f"a plan of seq_offsets {tuple(self.seq_offsets.shape)} at "
                            f"{self.seq_offsets.data_ptr():#x}, call's {tuple(seq_offsets.shape)} at "
                            f"{seq_offsets.data_ptr():#x}")
        if total != self.total:
            raise bad_value("plan", f"a plan for the call's {total} rows (q.shape[0])", f"a plan for {self.total}")
        mine = self.block.vis
        same = (vis.mode == mine.mode and _same_tensor(vis.func, mine.func)
                and _same_tensor(vis.num_targets, mine.num_targets)
                and (vis.contextual, vis.window, vis.min_full) == (mine.contextual, mine.window, mine.min_full))
        if not same:
            raise bad_value("plan", f"a plan for the call's mask, {_describe(vis)}", f"a plan for {_describe(mine)}")


def build_plan(seq_offsets: torch.Tensor, *, total: int, max_seq_len: int, attn_func: torch.Tensor | None = None,
               num_targets: torch.Tensor | None = None, causal: bool = True, max_attn_len: int = 0,
               contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0,
               device: torch.device | str | None = None) -> AttnPlan:
    """The block plan of a batch: ``seq_offsets (B + 1,)``, ``total`` rows, and the mask of ``hstu_mha``
    (``attn_func (Hf, NFUNC, total)``, or the fixed rule's arguments; docs/design.md, sections 2-3).

    ``device`` defaults to the offsets' device (and must be it). Nothing is read back from the device;
    the block tables are built now, the key-major plan of each dK/dV tile on first use.
    """
    if not isinstance(seq_offsets, torch.Tensor):
        raise bad_type("seq_offsets", "a torch.Tensor", type(seq_offsets).__name__)
    check_offsets_meta(seq_offsets)
    total = as_int("total", total)
    max_seq_len = as_int("max_seq_len", max_seq_len)
    if device is not None and torch.device(device) != seq_offsets.device:
        raise bad_value("device", f"the device of seq_offsets ({seq_offsets.device})", torch.device(device))
    fixed_args = dict(num_targets=num_targets, causal=causal, max_attn_len=max_attn_len,
                      contextual_seq_len=contextual_seq_len, min_full_attn_seq_len=min_full_attn_seq_len)
    if attn_func is not None:
        defaults = dict(num_targets=None, causal=True, max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0)
        for name, value in fixed_args.items():
            if value is not defaults[name] and value != defaults[name]:
                raise bad_value(name, f"its default ({defaults[name]}) when attn_func is given", value)
        check_func_meta(attn_func)
        if attn_func.shape[2] != total or attn_func.device != seq_offsets.device:
            raise bad_value("attn_func", f"(Hf, NFUNC, {total}) on {seq_offsets.device}",
                            f"{tuple(attn_func.shape)} on {attn_func.device}")
        if can_read_values(attn_func) and can_read_values(seq_offsets):
            validate(attn_func, seq_offsets)
        vis = visibility(func=attn_func)
    elif not causal:
        if (num_targets, max_attn_len, contextual_seq_len) != (None, 0, 0):
            raise bad_value("causal", "True when num_targets, max_attn_len or contextual_seq_len is given", causal)
        # Every row sees its whole sequence: interval 0 ends at the sequence length.
        _, _, length = row_coords(seq_offsets, total)
        vis = visibility(func=length.to(torch.int32)[None, None])
    else:
        if num_targets is not None and (num_targets.dim() != 1 or num_targets.numel() != seq_offsets.numel() - 1):
            raise bad_value("num_targets", f"shape ({seq_offsets.numel() - 1},)", tuple(num_targets.shape))
        plain = num_targets is None and max_attn_len == 0 and contextual_seq_len == 0
        vis = visibility(num_targets=num_targets, causal_closed_form=plain, contextual=as_int("contextual_seq_len",
                         contextual_seq_len), window=as_int("max_attn_len", max_attn_len),
                         min_full=as_int("min_full_attn_seq_len", min_full_attn_seq_len))
    return AttnPlan(seq_offsets, total, max_seq_len, vis)
