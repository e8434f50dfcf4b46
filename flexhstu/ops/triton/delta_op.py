"""Launch of the delta forward and its torch.library custom op (with a fake, for torch.export). Forward only."""

from __future__ import annotations

import torch

from .args import jagged
from .config import tiles
from .delta import delta_forward_kernel
from .limits import tile_dim
from .op import Visibility, _attention_args, _interpreting, _last_dim_contiguous
from .rules import MODE_CAUSAL, MODE_FIXED, MODE_FUNC
from .tables import block_table


def delta_forward(delta_q, k, v, offs, q_offs, q_start, vis: Visibility, alpha: float, out_scale: float):
    """``(total_q, H, Dv)``; offsets int64, ``q_start (B,)`` int64 (see ``delta_forward_kernel``)."""
    delta_q, k, v = _last_dim_contiguous(delta_q, k, v)
    total_q, nheads, dqk = delta_q.shape
    out = torch.zeros(total_q, nheads, v.shape[2], dtype=delta_q.dtype, device=delta_q.device)
    if total_q == 0 or k.shape[0] == 0:
        return out
    interpreting = _interpreting()
    tile = tiles(tile_dim(dqk), tile_dim(v.shape[2]), interpreting).forward
    qtab, nqb = block_table(q_offs, total_q, tile.block_m)
    delta_forward_kernel[(nqb, nheads)](
        **_attention_args(delta_q, k, v, offs, vis, alpha, interpreting), **tile.launch(),
        OUT=jagged(out), QOFFS=q_offs, QSTART=q_start, QTAB=qtab, n_flat=nqb, out_scale=out_scale,
    )
    return out


@torch.library.custom_op("flexhstu::delta_hstu_mha_fwd", mutates_args=())
def delta_hstu_mha_fwd(delta_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                       q_offsets: torch.Tensor, q_start: torch.Tensor, func: torch.Tensor | None,
                       num_targets: torch.Tensor | None, mode: int, contextual: int, window: int, min_full: int,
                       alpha: float, out_scale: float) -> torch.Tensor:
    vis = Visibility(mode, func, num_targets, contextual, window, min_full)
    return delta_forward(delta_q, k, v, seq_offsets, q_offsets, q_start, vis, alpha, out_scale)


@delta_hstu_mha_fwd.register_fake
def _(delta_q, k, v, seq_offsets, q_offsets, q_start, func, num_targets, mode, contextual, window, min_full, alpha,
      out_scale):
    return delta_q.new_empty(delta_q.shape[0], delta_q.shape[1], v.shape[2])


def triton_delta_hstu_mha(delta_q, k, v, seq_offsets, q_offsets, q_start, *, func=None, num_targets=None,
                          causal_closed_form=False, contextual: int = 0, window: int = 0, min_full: int = 0,
                          alpha: float, out_scale: float) -> torch.Tensor:
    """The custom op: ``func`` given decides visibility; else causal or the fixed rule in closed form."""
    mode = MODE_FUNC if func is not None else (MODE_CAUSAL if causal_closed_form else MODE_FIXED)
    as64 = lambda x: x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()
    nt = None if num_targets is None else as64(num_targets)
    return delta_hstu_mha_fwd(delta_q, k, v, as64(seq_offsets), as64(q_offsets), as64(q_start), func, nt, int(mode),
                              contextual, window, min_full, alpha, out_scale)
