"""The STU layer (HSTU's sequential transduction unit) and a stack of them sharing one mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import Kernel, hstu_mha


@dataclass(kw_only=True)
class STULayerConfig:
    """One STU layer's sizes. Keyword-only: the generative-recommenders config orders its fields differently
    (``hidden_dim`` before ``attention_dim``), so a positional call could swap them silently."""

    embedding_dim: int = 64
    num_heads: int = 2
    attention_dim: int = 32  # per head, for q and k
    hidden_dim: int = 32  # per head, for u and v
    dropout: float = 0.1
    kernel: Kernel = Kernel.AUTO


class STULayer(nn.Module):
    """x -> LN -> [u|v|q|k] -> u = silu(u) -> a = hstu_mha(q, k, v) -> y = u * LN(a) -> dropout -> W [u, a, y] -> + x.

    Takes jagged ``x (total, D)``; the mask (``attn_func`` or the fixed-rule arguments) is built once
    per batch by the caller and passed through ``mask_kwargs``.
    """

    def __init__(self, cfg: STULayerConfig):
        super().__init__()
        self.cfg = cfg
        h, da, dh = cfg.num_heads, cfg.attention_dim, cfg.hidden_dim
        self.norm = nn.LayerNorm(cfg.embedding_dim)
        self.uvqk = nn.Linear(cfg.embedding_dim, h * (2 * dh + 2 * da))
        self.attn_norm = nn.LayerNorm(h * dh)
        self.out = nn.Linear(3 * h * dh, cfg.embedding_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, **mask_kwargs) -> torch.Tensor:
        cfg = self.cfg
        h, da, dh = cfg.num_heads, cfg.attention_dim, cfg.hidden_dim
        u, v, q, k = torch.split(self.uvqk(self.norm(x)), [h * dh, h * dh, h * da, h * da], dim=-1)
        u = F.silu(u)
        a = hstu_mha(max_seq_len, None, q.reshape(-1, h, da), k.reshape(-1, h, da), v.reshape(-1, h, dh), seq_offsets,
                     kernel=cfg.kernel, **mask_kwargs).reshape(-1, h * dh)
        y = self.dropout(u * self.attn_norm(a))
        return x + self.out(torch.cat([u, a, y], dim=-1))


class STUStack(nn.Module):
    """``num_layers`` STU layers run on one mask built once per batch, then a final layer norm."""

    def __init__(self, cfg: STULayerConfig, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(STULayer(cfg) for _ in range(num_layers))
        self.norm = nn.LayerNorm(cfg.embedding_dim)

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, **mask_kwargs) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, seq_offsets, max_seq_len, **mask_kwargs)
        return self.norm(x)
