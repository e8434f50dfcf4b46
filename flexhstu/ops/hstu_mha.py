"""``hstu_mha``: input checks, mask selection and backend dispatch.

Checks never read device memory of CUDA tensors (no host-device sync in the hot
path): value checks on ``seq_offsets`` / ``num_targets`` run on CPU tensors
outside torch.compile only; ``masks.validate`` does them for CUDA tensors when asked.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .._errors import bad_type, bad_value
from ..jagged import check_offsets_meta, check_offsets_values, row_coords
from ..masks.format import check_func_meta
from ..masks.rules import FixedRule
from .cutlass import unavailable_reason
from .kernel import Kernel
from .pytorch import pytorch_hstu_mha

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise bad_type(name, "a torch.Tensor", type(x).__name__)
        if x.dim() != 3:
            raise bad_value(name, "a 3-D jagged tensor (total, H, D)", f"shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise bad_type(name, "float16, bfloat16, float32 or float64", x.dtype)
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != q.shape[0]:
            raise bad_value(f"{name}.shape[0]", f"the rows of q ({q.shape[0]})", x.shape[0])
        if x.shape[1] != q.shape[1]:
            raise bad_value(f"{name}.shape[1] (heads)", f"the heads of q ({q.shape[1]})", x.shape[1])
        if x.dtype != q.dtype:
            raise bad_type(f"{name}.dtype", f"the dtype of q ({q.dtype})", x.dtype)
        if x.device != q.device:
            raise bad_value(f"{name}.device", f"the device of q ({q.device})", x.device)
    if k.shape[2] != q.shape[2]:
        raise bad_value("k.shape[2] (Dqk)", f"the head dim of q ({q.shape[2]})", k.shape[2])


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    attn_func: torch.Tensor | None = None,
    scaling_seqlen: int = -1,
    kernel: Kernel = Kernel.AUTO,
) -> torch.Tensor:
    """HSTU attention over a jagged batch: ``O = (silu(alpha Q K^T) * M) V / scaling_seqlen``.

    q, k: ``(total, H, Dqk)``; v: ``(total, H, Dv)``; seq_offsets: ``(B + 1,)``;
    returns ``(total, H, Dv)``. ``attn_func`` (int32 ``(Hf, NFUNC, total)``,
    ``Hf in {1, H}``) alone decides visibility when given; otherwise the fixed
    rule (causal, targets, contextual prefix, window) applies. ``alpha=None``
    means ``1/sqrt(Dqk)``; ``scaling_seqlen <= 0`` means ``max_seq_len``.
    """
    _check_qkv(q, k, v)
    check_offsets_meta(seq_offsets)
    if seq_offsets.device != q.device:
        raise bad_value("seq_offsets.device", f"the device of q ({q.device})", seq_offsets.device)
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise bad_value("max_seq_len", "a non-negative int", max_seq_len)
    if not (0.0 <= float(dropout_pr) < 1.0):
        raise bad_value("dropout_pr", "a probability in [0, 1)", dropout_pr)
    for name, val in (("max_attn_len", max_attn_len), ("contextual_seq_len", contextual_seq_len), ("min_full_attn_seq_len", min_full_attn_seq_len)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise bad_value(name, "a non-negative int", val)
    total, nheads, dqk = q.shape
    if alpha is None:
        alpha = dqk**-0.5
    scaling = float(max_seq_len if scaling_seqlen is None or scaling_seqlen <= 0 else scaling_seqlen)
    if scaling <= 0:
        scaling = 1.0
    if num_targets is not None:
        if not isinstance(num_targets, torch.Tensor) or num_targets.dim() != 1 or num_targets.numel() != seq_offsets.numel() - 1:
            raise bad_value("num_targets", f"a ({seq_offsets.numel() - 1},) tensor", getattr(num_targets, "shape", num_targets))
        if num_targets.device != q.device:
            raise bad_value("num_targets.device", f"the device of q ({q.device})", num_targets.device)
    if attn_func is not None:
        extra = [
            name
            for name, val, default in (
                ("causal", causal, True),
                ("num_targets", num_targets, None),
                ("max_attn_len", max_attn_len, 0),
                ("contextual_seq_len", contextual_seq_len, 0),
                ("min_full_attn_seq_len", min_full_attn_seq_len, 0),
            )
            if (val is not default and val != default)
        ]
        if extra:
            raise ValueError(
                f"attn_func: the func alone decides visibility; leave {', '.join(extra)} at the default "
                "(encode targets, windows and prefixes in the func with flexhstu.masks)"
            )
        check_func_meta(attn_func, total=total, nheads=nheads, arg="attn_func")
        if attn_func.device != q.device:
            raise bad_value("attn_func.device", f"the device of q ({q.device})", attn_func.device)
    if not q.is_cuda and not torch.compiler.is_compiling():
        _check_values_on_host(seq_offsets, total, max_seq_len, num_targets)

    kernel = Kernel(kernel)
    if kernel == Kernel.AUTO:
        use_triton = (
            q.is_cuda
            and triton_available()
            and q.dtype != torch.float64
            and not (dropout_pr > 0.0 and training)
        )
        kernel = Kernel.TRITON if use_triton else Kernel.PYTORCH
    if kernel == Kernel.CUTLASS:
        raise RuntimeError(unavailable_reason())
    if kernel == Kernel.TRITON:
        return _run_triton(
            max_seq_len, alpha, q, k, v, seq_offsets, causal, dropout_pr, training, num_targets,
            max_attn_len, contextual_seq_len, min_full_attn_seq_len, attn_func, scaling,
        )
    mask = attn_func if attn_func is not None else FixedRule(
        causal, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len
    )
    return pytorch_hstu_mha(
        q, k, v, seq_offsets, mask, alpha=alpha, scaling_seqlen=scaling, max_seq_len=max_seq_len,
        dropout_pr=dropout_pr if training else 0.0,
    )

def _check_values_on_host(seq_offsets: torch.Tensor, total: int, max_seq_len: int, num_targets: torch.Tensor | None) -> None:
    check_offsets_values(seq_offsets, total=total)
    offs = seq_offsets.to(torch.int64)
    lengths = offs[1:] - offs[:-1]
    if lengths.numel() and int(lengths.max()) > max_seq_len:
        b = int(torch.argmax(lengths))
        raise bad_value("max_seq_len", f"at least every sequence length (sequence {b} has {int(lengths[b])})", max_seq_len)
    if num_targets is not None:
        nt = num_targets.to(torch.int64)
        bad = (nt < 0) | (nt > lengths)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0, 0])
            raise bad_value(f"num_targets[{b}]", f"0 <= T <= the sequence length {int(lengths[b])}", int(nt[b]))


def _run_triton(max_seq_len, alpha, q, k, v, seq_offsets, causal, dropout_pr, training, num_targets,
                max_attn_len, contextual_seq_len, min_full_attn_seq_len, attn_func, scaling):
    if not triton_available():
        raise RuntimeError("Kernel.TRITON needs triton (pip install 'flexhstu[gpu]'), which is not installed")
    if not q.is_cuda and not _interpreting():
        raise RuntimeError("Kernel.TRITON runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1); got q on " + str(q.device))
    if dropout_pr > 0.0 and training:
        raise ValueError(f"dropout_pr: Kernel.TRITON has no dropout; expected 0.0 (or training=False), got {dropout_pr}")
    if q.dtype == torch.float64:
        raise TypeError("q: Kernel.TRITON supports float16, bfloat16 and float32; got torch.float64 (use Kernel.PYTORCH)")
    from .triton import triton_hstu_mha

    if attn_func is not None:
        return triton_hstu_mha(q, k, v, seq_offsets, func=attn_func, alpha=float(alpha), out_scale=1.0 / scaling,
                               max_seq_len=max_seq_len)
    plain = num_targets is None and max_attn_len == 0 and contextual_seq_len == 0
    if not causal:
        if not plain:
            raise ValueError(
                "causal=False with num_targets/max_attn_len/contextual_seq_len is not supported by Kernel.TRITON; "
                "build the mask with flexhstu.masks (or masks.from_dense) and pass attn_func"
            )
        _, _, length = row_coords(seq_offsets, q.shape[0])  # every row sees its whole sequence
        return triton_hstu_mha(q, k, v, seq_offsets, func=length.to(torch.int32)[None, None], alpha=float(alpha),
                               out_scale=1.0 / scaling, max_seq_len=max_seq_len)
    return triton_hstu_mha(
        q, k, v, seq_offsets, num_targets=num_targets, causal_closed_form=plain, contextual=contextual_seq_len,
        window=max_attn_len, min_full=min_full_attn_seq_len, alpha=float(alpha), out_scale=1.0 / scaling,
        max_seq_len=max_seq_len,
    )
