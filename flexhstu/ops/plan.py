"""Block plans built once per batch and shared by every attention call on it (docs/design.md, section 8).

    plan = flexhstu.build_plan(seq_offsets, total=total, max_seq_len=n, attn_func=func, sparse=True)
    for layer in layers:                  # forward and backward of every layer reuse the plan
        x = layer(x, ..., attn_func=func, attn_plan=plan)   # -> hstu_mha(..., attn_func=func, attn_plan=plan)

A plan depends on the offsets and the mask, never on q, k, v. It records the mask it was built for, so a
call with another mask or other offsets is refused (host metadata only: no device read). For the Triton
kernels it holds the block tables and, per dK/dV tile (which follows the head dims), the key-major plan,
built on first use on the GPU with no host-device sync, so building and using it can be captured in a
CUDA graph. The PyTorch reference needs no plan and ignores it after the check; building one never
imports Triton, so a model builds its plan the same way on any device.

``DeltaPlan`` does the same for ``delta_hstu_mha``, one micro-batch at a time: it keeps the tables its Triton
kernel makes from the offsets for the next call on the same offsets.
"""

from __future__ import annotations

import torch

from .._errors import as_bool, as_int, as_span, bad_type, bad_value
from ..jagged import can_read_values, check_offsets_meta, row_coords
from ..masks.format import check_func_meta, validate
from ..masks.rules import FixedRule


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same storage, shape and strides (host metadata only: no device read)."""
    if a is None or b is None:
        return a is b
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
        and a.dtype == b.dtype
    )


def _version(t: torch.Tensor | None) -> int | None:
    """``t``'s in-place version counter (host metadata), None for no tensor or an inference-mode tensor, which
    has none."""
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:
        return None


def _versions(seq_offsets: torch.Tensor, mask: torch.Tensor | FixedRule) -> tuple:
    return _version(seq_offsets), _version(mask if isinstance(mask, torch.Tensor) else mask.num_targets)


def _describe(mask: torch.Tensor | FixedRule) -> str:
    if isinstance(mask, torch.Tensor):
        return f"attn_func of shape {tuple(mask.shape)} at {mask.data_ptr():#x}"
    nt = "none" if mask.num_targets is None else f"at {mask.num_targets.data_ptr():#x}"
    return (
        f"the fixed rule (causal {mask.causal}, num_targets {nt}, max_attn_len {mask.max_attn_len}, "
        f"contextual_seq_len {mask.contextual_seq_len}, min_full_attn_seq_len {mask.min_full_attn_seq_len})"
    )


def _describe_kind(mask: torch.Tensor | FixedRule) -> str:
    """``_describe`` without storage addresses (traceable)."""
    if isinstance(mask, torch.Tensor):
        return "an attn_func"
    nt = "none" if mask.num_targets is None else "a tensor"
    return (
        f"the fixed rule (causal {mask.causal}, num_targets {nt}, max_attn_len {mask.max_attn_len}, "
        f"contextual_seq_len {mask.contextual_seq_len}, min_full_attn_seq_len {mask.min_full_attn_seq_len})"
    )


def _same_mask(a: torch.Tensor | FixedRule, b: torch.Tensor | FixedRule) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    return (
        a.causal == b.causal
        and _same_tensor(a.num_targets, b.num_targets)
        and (a.max_attn_len, a.contextual_seq_len, a.min_full_attn_seq_len)
        == (b.max_attn_len, b.contextual_seq_len, b.min_full_attn_seq_len)
    )


class AttnPlan:
    """The block plan of one batch and one mask; see ``build_plan``.

    ``mask``: the func tensor or the fixed rule's parameters, as ``hstu_mha`` receives them; ``sparse``: the
    tile family the Triton kernels use (None: decided from the mask, see ``build_plan``).
    """

    def __init__(
        self,
        seq_offsets: torch.Tensor,
        total: int,
        max_seq_len: int,
        mask: torch.Tensor | FixedRule,
        sparse: bool | None,
    ):
        self.seq_offsets, self.total, self.max_seq_len = seq_offsets, total, max_seq_len
        self.mask, self.sparse = mask, sparse
        # Version counters are not traceable; a plan built under torch.compile is used by compiled calls only,
        # which never read its tables.
        self._versions = None if torch.compiler.is_compiling() else _versions(seq_offsets, mask)
        self._block = None

    @property
    def block(self):
        """The Triton block plan (``ops.triton.block_plan.BlockPlan``), made on first use."""
        if self._block is None:
            from .triton.block_plan import BlockPlan
            from .triton.launch import visibility

            offs = self.seq_offsets.to(torch.int64).contiguous()
            mask = self.mask
            if isinstance(mask, torch.Tensor):
                vis = visibility(func=mask, sparse=self.sparse)
            elif not mask.causal:  # every row sees its whole sequence: interval 0 ends at the length
                _, _, length = row_coords(self.seq_offsets, self.total)
                vis = visibility(func=length.to(torch.int32)[None, None], sparse=self.sparse)
            else:
                plain = mask.num_targets is None and mask.max_attn_len == 0 and mask.contextual_seq_len == 0
                vis = visibility(
                    num_targets=mask.num_targets,
                    causal_closed_form=plain,
                    contextual=mask.contextual_seq_len,
                    window=mask.max_attn_len,
                    min_full=mask.min_full_attn_seq_len,
                    sparse=self.sparse,
                    max_seq_len=self.max_seq_len,
                )
            self._block = BlockPlan(offs, self.total, vis)
        return self._block

    @property
    def func(self) -> torch.Tensor | None:
        """The func the Triton kernels read: the call's, the plan's own all-visible func for ``causal=False``,
        or None for the closed-form causal and fixed rules."""
        return self.block.vis.func

    def check(self, seq_offsets: torch.Tensor, total: int, mask: torch.Tensor | FixedRule) -> None:
        """Raise unless a call with these offsets, ``total`` rows and mask is the one this plan was built for.

        Under torch.compile only what tracing can compare is checked (rows, the kind of mask and its scalar
        parameters): storage addresses and version counters are not traceable, and a compiled call never
        runs on the plan's tables (the op builds its own in the graph; the plan only picks the tiles), so a
        plan of other offsets cannot make it wrong.
        """
        if torch.compiler.is_compiling():
            self._check_traceable(total, mask)
            return
        if not _same_tensor(seq_offsets, self.seq_offsets):
            raise bad_value(
                "attn_plan",
                "a plan built from this call's seq_offsets tensor (same storage and shape)",
                f"a plan of seq_offsets {tuple(self.seq_offsets.shape)} at "
                f"{self.seq_offsets.data_ptr():#x}, call's {tuple(seq_offsets.shape)} at "
                f"{seq_offsets.data_ptr():#x}",
            )
        if total != self.total:
            raise bad_value("attn_plan", f"a plan for the call's {total} rows (q.shape[0])", f"a plan for {self.total}")
        if not _same_mask(mask, self.mask):
            raise bad_value(
                "attn_plan", f"a plan for the call's mask, {_describe(mask)}", f"a plan for {_describe(self.mask)}"
            )
        if self._versions is not None and _versions(seq_offsets, mask) != self._versions:
            raise bad_value(
                "attn_plan",
                "a plan built after the last in-place change of seq_offsets, attn_func or "
                "num_targets (build_plan again)",
                "a plan built before such a change (the plan holds block tables of the old values)",
            )

    def _check_traceable(self, total: int, mask: torch.Tensor | FixedRule) -> None:
        if total != self.total:
            raise bad_value("attn_plan", f"a plan for the call's {total} rows (q.shape[0])", f"a plan for {self.total}")
        mine = self.mask
        if isinstance(mask, torch.Tensor) != isinstance(mine, torch.Tensor) or (
            not isinstance(mask, torch.Tensor)
            and (
                mask.causal != mine.causal
                or (mask.num_targets is None) != (mine.num_targets is None)
                or (mask.max_attn_len, mask.contextual_seq_len, mask.min_full_attn_seq_len)
                != (mine.max_attn_len, mine.contextual_seq_len, mine.min_full_attn_seq_len)
            )
        ):
            raise bad_value(
                "attn_plan", f"a plan for the call's mask, {_describe_kind(mask)}", f"a plan for {_describe_kind(mine)}"
            )

    def check_triton_call(
        self,
        seq_offsets: torch.Tensor,
        total: int,
        *,
        func,
        num_targets,
        causal_closed_form: bool,
        contextual: int,
        window: int,
        min_full: int,
    ) -> None:
        """``check`` for a call of ``triton_hstu_mha``, whose mask arguments are the kernels' (a func, closed-form
        causal, or the fixed rule's parameters); a ``causal=False`` plan is used through its own func."""
        if func is not None:
            own = (
                isinstance(self.mask, FixedRule)
                and not self.mask.causal
                and (torch.compiler.is_compiling() or func is self.func)
            )  # compiled: the call's own all-visible func
            mask = self.mask if own else func
        elif causal_closed_form:
            mask = FixedRule()
        else:
            mask = FixedRule(True, num_targets, window, contextual, min_full)
        self.check(seq_offsets, total, mask)


def build_plan(
    seq_offsets: torch.Tensor,
    *,
    total: int,
    max_seq_len: int,
    attn_func: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    causal: bool = True,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sparse: bool | None = None,
    device: torch.device | str | None = None,
) -> AttnPlan:
    """The block plan of a batch: ``seq_offsets (B + 1,)``, ``total`` rows, and the mask of ``hstu_mha``
    (``attn_func (Hf, NFUNC, total)``, or the fixed rule's arguments; docs/design.md, sections 2-3).

    ``sparse``: whether each query block sees few key blocks (windows, SLA), which makes the Triton kernels
    use smaller tiles; None decides from the mask: a fixed-rule window of at most a quarter of
    ``max_seq_len`` is sparse, causal and funcs are not (a func's sparsity lives in its values, which are not
    read). Results are the same either way; only speed differs.

    ``device`` defaults to the offsets' device (and must be it). Nothing is read back from the device;
    Triton's block tables and key-major plans are built when a call first needs them.

    A call refuses a plan whose offsets, func or num_targets changed in place after it was built (their
    version counters moved). Tensors made under ``torch.inference_mode`` have no version counter: change one
    in place and build the plan again, as nothing can tell.
    """
    if not isinstance(seq_offsets, torch.Tensor):
        raise bad_type("seq_offsets", "a torch.Tensor", type(seq_offsets).__name__)
    check_offsets_meta(seq_offsets)
    total = as_int("total", total)
    max_seq_len = as_int("max_seq_len", max_seq_len)
    if sparse is not None:
        try:
            sparse = as_bool("sparse", sparse)
        except TypeError:
            raise bad_type("sparse", "None or a bool (Python or NumPy)", type(sparse).__name__) from None
    if device is not None and torch.device(device) != seq_offsets.device:
        raise bad_value("device", f"the device of seq_offsets ({seq_offsets.device})", torch.device(device))
    fixed_args = dict(
        num_targets=num_targets,
        causal=causal,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len,
    )
    if attn_func is not None:
        defaults = dict(num_targets=None, causal=True, max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0)
        for name, value in fixed_args.items():
            if value is not defaults[name] and value != defaults[name]:
                raise bad_value(name, f"its default ({defaults[name]}) when attn_func is given", value)
        check_func_meta(attn_func, arg="attn_func")
        if attn_func.shape[2] != total or attn_func.device != seq_offsets.device:
            raise bad_value(
                "attn_func",
                f"(Hf, NFUNC, {total}) on {seq_offsets.device}",
                f"{tuple(attn_func.shape)} on {attn_func.device}",
            )
        if can_read_values(attn_func) and can_read_values(seq_offsets):
            validate(attn_func, seq_offsets)
        mask: torch.Tensor | FixedRule = attn_func
    else:
        causal = as_bool("causal", causal)
        if not causal and (num_targets, max_attn_len, contextual_seq_len) != (None, 0, 0):
            raise bad_value("causal", "True when num_targets, max_attn_len or contextual_seq_len is given", causal)
        if num_targets is not None and not isinstance(num_targets, torch.Tensor):
            raise bad_type("num_targets", "None or an integer tensor of shape (B,)", type(num_targets).__name__)
        if num_targets is not None and (num_targets.dim() != 1 or num_targets.numel() != seq_offsets.numel() - 1):
            raise bad_value("num_targets", f"shape ({seq_offsets.numel() - 1},)", tuple(num_targets.shape))
        mask = FixedRule(
            causal,
            num_targets,
            as_span("max_attn_len", max_attn_len),
            as_span("contextual_seq_len", contextual_seq_len),
            as_span("min_full_attn_seq_len", min_full_attn_seq_len),
        )
    return AttnPlan(seq_offsets, total, max_seq_len, mask, sparse)


class DeltaPlan:
    """What the Triton delta kernel prepares from a call's offsets, kept for the next call on the same offsets.

    Before its kernel, a ``delta_hstu_mha`` call launches two safe-offsets kernels and a block-table kernel
    (``ops.triton.delta_op.delta_tables``). Those depend on the key and query offsets, the key and query row
    counts and the kernel's query tile, never on q, k, v, the mask, ``q_start`` or ``kv_lengths``: every layer
    of an STU stack run on one micro-batch would launch the same three, and with a plan shared by them
    (``delta_hstu_mha(..., delta_plan=plan)``; ``serving.delta_layout`` makes one a micro-batch) only the first
    does. Unlike an ``AttnPlan`` it is never refused: it keeps what it last built, filed under everything that
    went into it (the two offsets tensors themselves and their in-place version counters, the row counts, the
    tile's rows), and a call that differs in any of them builds again and replaces it. Tensors made under
    ``torch.inference_mode`` have no version counter: change their values in place and pass a new plan. Its
    tables are written on the stream of the call that built them and are not ordered with other streams, and a
    plan built outside a CUDA graph capture is not rebuilt inside it (or the reverse): keep a plan to one stream
    and one side of a capture. Empty plans are cheap: make one per micro-batch. The PyTorch reference and traced
    calls (torch.compile, torch.export) do not use it.
    """

    def __init__(self):
        self._kept: tuple | None = None

    def prepared(self, tensors: tuple[torch.Tensor, ...], sizes: tuple, build) -> tuple:
        """``build()``, or what it returned for the same ``tensors`` (the same objects, unchanged in place since)
        and the same ``sizes``. A new entry replaces the last in one assignment, whole."""
        versions = tuple(_version(t) for t in tensors)
        kept = self._kept
        if (
            kept is None
            or len(kept[0]) != len(tensors)
            or any(a is not b for a, b in zip(kept[0], tensors))
            or kept[1:3] != (versions, sizes)
        ):
            kept = self._kept = (tensors, versions, sizes, build())
        return kept[3]
