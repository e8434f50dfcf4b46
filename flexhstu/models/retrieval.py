"""Next-item retrieval: HSTU (STU stack, causal or SLA mask), a SASRec-style softmax-attention
baseline of the same size, and popularity. Sampled-softmax training on cosine similarity."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import masks, serving
from .._errors import bad_value
from ..jagged import can_read_values, check_offsets_meta, check_offsets_values, row_coords
from ..nn import InputEncoder, STULayerConfig, STUStack
from ..ops import Kernel
from ..serving import HistoryCache


def item_encoder(num_items: int, dim: int, max_len: int, items: nn.Module | None = None) -> InputEncoder:
    """The input encoder; ``items`` replaces its item table (``num_items + 1`` rows, e.g. a table sharded across
    ranks, ``flexhstu.distributed.ItemTable``) without allocating the default one."""
    if items is None:
        return InputEncoder(num_items, dim, max_len)
    encoder = InputEncoder(0, dim, max_len)
    encoder.items = items
    return encoder


def check_heads(dim: int, heads: int) -> None:
    """Heads split the model width evenly; a remainder would silently make the attention narrower than ``dim``."""
    if heads < 1 or dim % heads:
        raise bad_value("heads", f"a divisor of dim={dim}", heads)


def stu_config(dim: int, heads: int, dropout: float, kernel: Kernel) -> STULayerConfig:
    """STU layers of width ``dim`` whose heads split it evenly (``dim // heads`` per head for q, k, u and v)."""
    check_heads(dim, heads)
    return STULayerConfig(
        embedding_dim=dim,
        num_heads=heads,
        attention_dim=dim // heads,
        hidden_dim=dim // heads,
        dropout=dropout,
        kernel=kernel,
    )


@dataclass
class SeqBatch:
    """A jagged batch of user histories: inputs, next-item targets (0 = none), offsets."""

    items: torch.Tensor
    times: torch.Tensor
    targets: torch.Tensor
    offsets: torch.Tensor
    max_len: int

    def to(self, device) -> SeqBatch:
        return SeqBatch(
            self.items.to(device), self.times.to(device), self.targets.to(device), self.offsets.to(device), self.max_len
        )


def make_batch(items: list[np.ndarray], times: list[np.ndarray], max_len: int, with_targets: bool = True) -> SeqBatch:
    """``with_targets``: inputs ``s[:-1]`` and targets ``s[1:]`` (the last ``max_len``); else inputs ``s`` (the last
    ``max_len``)."""
    ins, ts, tg, offs = [], [], [], [0]
    for s, t in zip(items, times):
        if with_targets:
            s_in, t_in, s_tg = s[:-1][-max_len:], t[:-1][-max_len:], s[1:][-max_len:]
        else:
            s_in, t_in, s_tg = s[-max_len:], t[-max_len:], np.zeros(min(len(s), max_len), dtype=np.int64)
        ins.append(s_in), ts.append(t_in), tg.append(s_tg)
        offs.append(offs[-1] + len(s_in))
    cat = lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.int64))
    lengths = np.diff(offs)
    return SeqBatch(cat(ins), cat(ts), cat(tg), torch.tensor(offs, dtype=torch.int64), int(lengths.max()))


class _Retrieval(nn.Module):
    """Shared training and scoring of next-item models: a subclass gives the ``encoder`` (whose item table is
    both input embedding and output layer) and ``states``."""

    temperature = 0.05

    def __init__(self, encoder: InputEncoder):
        super().__init__()
        self.encoder = encoder

    def states(self, batch: SeqBatch) -> torch.Tensor:  # (total, D)
        raise NotImplementedError

    def item_table(self) -> torch.Tensor:
        return F.normalize(self.encoder.items.weight, dim=-1)

    def sample_negatives(self, num_negatives: int, generator: torch.Generator) -> torch.Tensor:
        """``(num_negatives,)`` item ids drawn uniformly from ``generator`` (on its device)."""
        return torch.randint(1, self.encoder.items.weight.shape[0], (num_negatives,), generator=generator)

    def forward(
        self,
        batch: SeqBatch,
        num_negatives: int = 0,
        generator: torch.Generator | None = None,
        *,
        negatives: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sampled softmax over the target and ``num_negatives`` uniform negatives shared by the batch, drawn from
        ``generator``; or over the given ``negatives (K,)`` item ids (``sample_negatives``): a generator cannot
        be traced, so a model compiled whole draws its negatives outside.

        Only the rows of the targets and the negatives are read (one lookup through the item table module), so a
        table sharded across ranks is never gathered whole."""
        h = F.normalize(self.states(batch), dim=-1)
        # Rows without a target (0) are weighted out rather than dropped: no data-dependent shape, so the model
        # compiles whole; the mean is over the rows with a target, as before.
        tgt = batch.targets
        keep = (tgt > 0).to(h.dtype)
        neg = (self.sample_negatives(num_negatives, generator) if negatives is None else negatives).to(h.device)
        rows = F.normalize(self.encoder.items(torch.cat([tgt, neg])), dim=-1)
        pos_logit = (h * rows[: len(tgt)]).sum(-1, keepdim=True)
        neg_logit = h @ rows[len(tgt) :].T
        neg_logit = neg_logit.masked_fill(neg[None, :] == tgt[:, None], float("-inf"))  # accidental hits
        logits = torch.cat([pos_logit, neg_logit], dim=1) / self.temperature
        losses = F.cross_entropy(logits, torch.zeros(len(tgt), dtype=torch.long, device=h.device), reduction="none")
        return (losses * keep).sum() / keep.sum()

    @torch.no_grad()
    def scores(self, batch: SeqBatch) -> torch.Tensor:
        """(B, num_items + 1) scores from each user's last state."""
        h = F.normalize(self.states(batch), dim=-1)
        last = h[batch.offsets[1:] - 1]
        return last @ self.item_table().T


class HSTURetrieval(_Retrieval):
    """``rel_bias``: each layer adds the published relative attention bias (positions up to ``max_len``).
    ``items``: the item table module (default a new ``nn.Embedding``), see ``item_encoder``."""

    def __init__(
        self,
        num_items: int,
        dim: int = 64,
        layers: int = 2,
        heads: int = 2,
        max_len: int = 200,
        mask: str = "causal",
        sla_k1: int = 32,
        sla_k2: int = 4,
        dropout: float = 0.2,
        kernel: Kernel = Kernel.AUTO,
        rel_bias: bool = True,
        items: nn.Module | None = None,
    ):
        if mask not in ("causal", "sla"):
            raise bad_value("mask", "'causal' or 'sla'", repr(mask))
        super().__init__(item_encoder(num_items, dim, max_len, items))
        cfg = replace(stu_config(dim, heads, dropout, kernel), rel_bias=rel_bias, rel_bias_max_len=max_len)
        self.stack = STUStack(cfg, layers)
        self.mask, self.sla_k1, self.sla_k2 = mask, sla_k1, sla_k2
        self.dropout = nn.Dropout(dropout)

    def states(self, batch: SeqBatch) -> torch.Tensor:
        x = self.dropout(self.encoder(batch.items, batch.times, batch.offsets))
        kw = {}
        if self.mask == "sla":
            kw["attn_func"] = masks.sla(batch.offsets, self.sla_k1, self.sla_k2, total=x.shape[0])
            kw["sparse"] = 4 * (self.sla_k1 + self.sla_k2) <= batch.max_len  # few key blocks per query block
        return self.stack(x, batch.offsets, batch.max_len, batch.times, **kw)

    def _history_mask(self, offsets: torch.Tensor, total: int) -> dict:
        if self.mask == "sla":
            return {"attn_func": masks.sla(offsets, self.sla_k1, self.sla_k2, total=total)}
        return {}

    @torch.no_grad()
    def cache_histories(self, cache: HistoryCache, users: Sequence[Hashable], batch: SeqBatch) -> None:
        """Store the users' history K/V and last states (``batch``: one history per user, no targets needed).
        Positions count back from a history's end, so a grown history is cached again."""
        if self.training:
            raise RuntimeError("HSTURetrieval: expected eval mode for cached scoring (call .eval()), got training mode")
        x = self.encoder(batch.items, batch.times, batch.offsets)
        serving.prefill(self.stack, cache, users, x, batch.offsets, mask=self._history_mask)

    @torch.no_grad()
    def score_cached(
        self, cache: HistoryCache, users: Sequence[Hashable], cand_items: torch.Tensor, cand_offsets: torch.Tensor
    ) -> torch.Tensor:
        """Next-item scores ``(C,)`` of candidates ``cand_items (C,)`` (jagged by ``cand_offsets (B + 1,)``):
        cosine of each user's cached last state with the item, as ``scores`` computes it for every item.
        The candidates are read out, not attended, so no attention runs at request time."""
        check_offsets_meta(cand_offsets, "cand_offsets")
        if len(users) != cand_offsets.numel() - 1:
            raise bad_value("users", f"one user per candidate sequence ({cand_offsets.numel() - 1})", len(users))
        if can_read_values(cand_offsets):
            check_offsets_values(cand_offsets, "cand_offsets", total=cand_items.shape[0])
        last = cache.last(users)
        empty = [u for u, h in zip(users, last) if h is None]
        if empty:
            raise bad_value(
                "users",
                "users with a non-empty cached history (the state is the last row's)",
                f"{empty[0]!r} with none",
            )
        h = F.normalize(torch.stack(last), dim=-1)
        # Each candidate's user by search: in bounds whatever the offsets hold (their values are read only on the
        # CPU: no sync per request on CUDA).
        rows = row_coords(cand_offsets.to(h.device), cand_items.shape[0])[0]
        return (h[rows] * self.item_table()[cand_items]).sum(-1)


class SASRecRetrieval(_Retrieval):
    """Softmax self-attention (pre-norm transformer, causal) with the same embeddings and size."""

    def __init__(
        self,
        num_items: int,
        dim: int = 64,
        layers: int = 2,
        heads: int = 2,
        max_len: int = 200,
        dropout: float = 0.2,
        items: nn.Module | None = None,
    ):
        check_heads(dim, heads)
        super().__init__(item_encoder(num_items, dim, max_len, items))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def states(self, batch: SeqBatch) -> torch.Tensor:
        x = self.dropout(self.encoder(batch.items, batch.times, batch.offsets))
        offs = batch.offsets
        lengths = offs[1:] - offs[:-1]
        n = batch.max_len
        pos = torch.arange(n, device=x.device)
        valid = pos[None, :] < lengths[:, None]
        rows = (offs[:-1, None] + pos[None, :]).clamp(max=x.shape[0] - 1)
        padded = x[rows] * valid[..., None]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        out = self.norm(self.blocks(padded, mask=causal, src_key_padding_mask=~valid, is_causal=True))
        return out[valid]


class Popularity:
    """Scores every item by its training count."""

    def __init__(self, train_items: list[np.ndarray], num_items: int):
        counts = np.bincount(np.concatenate(train_items), minlength=num_items + 1).astype(np.float64)
        counts[0] = -np.inf
        self.counts = torch.from_numpy(counts)

    def scores(self, batch: SeqBatch) -> torch.Tensor:
        return self.counts.expand(batch.offsets.numel() - 1, -1).to(torch.float32)
