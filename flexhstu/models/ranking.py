"""Multi-task ranking with OneRank: history, then candidates each followed by K task tokens.

MovieLens tasks: watched (a real next interaction vs a sampled unwatched item), rated >= 4, rated 5.
The ablation replaces task tokens with one plain target token per candidate under the fixed
targets mask (targets see the history and themselves), read out by the same per-task head.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import masks, serving
from .._errors import bad_value
from ..masks.rules import FixedRule
from ..nn import OneRankHead, OneRankTokenizer, STUStack
from ..nn.encoding import check_item_ids
from ..ops import Kernel
from ..ops.capability import triton_unsupported_reason
from ..serving import HistoryCache, JaggedHistory
from .retrieval import item_encoder, stu_config

TASKS = ("watched", "rated>=4", "rated5")


@dataclass
class RankingRequests:
    """Requests: a history and a candidate list with (C, 3) labels each."""

    hist_items: list[np.ndarray]
    hist_times: list[np.ndarray]
    cand_items: list[np.ndarray]
    labels: list[np.ndarray]


def _request(items, ratings, times, cut, n_pos, n_neg, rng, num_items, max_len):
    pos = items[cut : cut + n_pos]
    seen = set(items.tolist())
    neg = []
    while len(neg) < n_neg:
        x = int(rng.integers(1, num_items + 1))
        if x not in seen:
            neg.append(x)
    r = ratings[cut : cut + n_pos]
    lab_pos = np.stack([np.ones(len(pos)), r >= 4, r >= 5], axis=1)
    cand = np.concatenate([pos, np.array(neg, dtype=np.int64)])
    labels = np.concatenate([lab_pos, np.zeros((n_neg, 3))]).astype(np.float32)
    order = rng.permutation(len(cand))
    return items[:cut][-max_len:], times[:cut][-max_len:], cand[order], labels[order]


def min_events(n_pos: int = 5) -> int:
    """Events a user needs to give train, validation and test requests of ``n_pos`` positives each."""
    return 3 * n_pos + 2


def make_requests(
    seqs, split: str, n_pos: int = 5, n_neg: int = 5, per_user: int = 2, max_len: int = 200, seed: int = 0
) -> RankingRequests:
    """``test``: each user's last ``n_pos`` events; ``valid``: the ``n_pos`` before them;
    ``train``: ``per_user`` random cut points that end before the validation window. Users with fewer than
    ``min_events(n_pos)`` events or fewer than ``n_neg`` unseen items give no request."""
    rng = np.random.default_rng(seed)
    out = RankingRequests([], [], [], [])
    for items, ratings, times in zip(seqs.items, seqs.ratings, seqs.times):
        if len(items) < min_events(n_pos) or seqs.num_items - len(set(items.tolist())) < n_neg:
            continue  # too short for three windows, or too few unseen items to sample negatives from
        L = len(items)
        if split == "test":
            cuts = [L - n_pos]
        elif split == "valid":
            cuts = [L - 2 * n_pos]
        else:
            cuts = rng.integers(2, L - 3 * n_pos + 1, size=per_user).tolist()
        for c in cuts:
            h, t, cand, lab = _request(items, ratings, times, c, n_pos, n_neg, rng, seqs.num_items, max_len)
            out.hist_items.append(h), out.hist_times.append(t), out.cand_items.append(cand), out.labels.append(lab)
    return out


@dataclass
class RankingBatch:
    """Requests collated into jagged tensors: histories ``(T_h,)`` by ``hist_offsets (B + 1,)``, candidates
    ``(C,)`` by ``cand_offsets (B + 1,)`` and their labels ``(C, len(TASKS))``."""

    hist_items: torch.Tensor
    hist_times: torch.Tensor
    hist_offsets: torch.Tensor
    cand_items: torch.Tensor
    cand_offsets: torch.Tensor
    labels: torch.Tensor

    def to(self, device) -> RankingBatch:
        return RankingBatch(
            *(
                t.to(device)
                for t in (
                    self.hist_items,
                    self.hist_times,
                    self.hist_offsets,
                    self.cand_items,
                    self.cand_offsets,
                    self.labels,
                )
            )
        )

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The arguments of ``OneRankModel.forward``."""
        return self.hist_items, self.hist_times, self.hist_offsets, self.cand_items, self.cand_offsets


def collate(req: RankingRequests, idx: list[int]) -> RankingBatch:
    """The requests ``idx`` of ``req`` as one ``RankingBatch`` (CPU tensors)."""

    def offsets(lists):
        return torch.tensor(np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64))

    def cat(lists):
        return torch.from_numpy(np.concatenate(lists))

    hist = [req.hist_items[i] for i in idx]
    cand = [req.cand_items[i] for i in idx]
    return RankingBatch(
        cat(hist),
        cat([req.hist_times[i] for i in idx]),
        offsets(hist),
        cat(cand),
        offsets(cand),
        cat([req.labels[i] for i in idx]),
    )


class OneRankModel(nn.Module):
    def __init__(
        self,
        num_items: int,
        dim: int = 64,
        layers: int = 2,
        heads: int = 2,
        max_len: int = 200,
        task_tokens: bool = True,
        dropout: float = 0.2,
        kernel: Kernel = Kernel.AUTO,
        items: nn.Module | None = None,
    ):
        super().__init__()
        k = len(TASKS)
        self.encoder = item_encoder(num_items, dim, max_len, items)
        self.tokenizer = OneRankTokenizer(k if task_tokens else 0, dim)
        self.stack = STUStack(stu_config(dim, heads, dropout, kernel), layers)
        self.head = OneRankHead(k, dim)
        self.task_tokens = task_tokens
        self.dropout = nn.Dropout(dropout)

    @property
    def group_size(self) -> int:
        """Tokens per candidate: the candidate and its task tokens (1 in the ablation)."""
        return self.tokenizer.group_size

    def forward(
        self,
        hist_items: torch.Tensor,
        hist_times: torch.Tensor,
        hist_offsets: torch.Tensor,
        cand_items: torch.Tensor,
        cand_offsets: torch.Tensor,
        max_seq_len: int | None = None,
    ) -> torch.Tensor:
        """Scores ``(C, len(TASKS))`` of candidates ``cand_items (C,)`` (jagged by ``cand_offsets (B + 1,)``)
        after histories ``hist_items, hist_times (T_h,)`` (jagged by ``hist_offsets (B + 1,)``).

        ``max_seq_len`` (the attention's length bound and scale) defaults to the batch's longest sequence;
        a cache fixes it (``HistoryCache.max_seq_len``), and this forward with the same value is the full
        recompute that ``score_cached`` equals."""
        hist = self.encoder(hist_items, hist_times, hist_offsets)
        check_item_ids(cand_items, self.encoder.items, "cand_items")
        cand = self.encoder.items(cand_items)
        b = self.tokenizer(self.dropout(hist), hist_offsets, cand, cand_offsets)
        n, scale = max_seq_len, None
        if n is None and b.max_seq_len is not None:
            n = b.max_seq_len
        elif n is None:
            # Under torch.compile the longest sequence stays on the device: the attention multiplies by its
            # reciprocal (the same output scale) and gets the row count as its length bound.
            n, scale = b.x.shape[0], 1.0 / b.longest.to(torch.float32).clamp_min(1.0)
        if self.task_tokens:
            func = masks.onerank(b.seq_offsets, b.num_targets, self.tokenizer.group_size, total=b.x.shape[0])
            out = self.stack(b.x, b.seq_offsets, n, attn_func=func, attn_scale=scale)
            z = out[b.task_rows]
        else:
            out = self.stack(b.x, b.seq_offsets, n, num_targets=b.num_targets, attn_scale=scale)
            z = out[b.candidate_rows][:, None, :].expand(-1, len(TASKS), -1)
        return self.head(z)

    @torch.no_grad()
    def cache_histories(
        self,
        cache: HistoryCache,
        users: Sequence[Hashable],
        hist_items: torch.Tensor,
        hist_times: torch.Tensor,
        hist_offsets: torch.Tensor,
    ) -> None:
        """Compute and store the users' history K/V (``hist_* (T_h,)`` jagged by ``hist_offsets (B + 1,)``).

        Positions are counted back from a history's end, so a grown history changes every row's input:
        cache it again (``serving.extend`` is exact only for inputs that do not change)."""
        _check_eval(self)
        x = self.encoder(hist_items, hist_times, hist_offsets)
        serving.prefill(self.stack, cache, users, x, hist_offsets)

    @torch.no_grad()
    def score_cached(
        self,
        cache: HistoryCache,
        users: Sequence[Hashable],
        cand_items: torch.Tensor,
        cand_offsets: torch.Tensor,
        micro_batch: int | None = None,
        cuda_graphs: bool | None = None,
        graph_pool: serving.GraphPool | None = None,
        fp8: bool = False,
    ) -> torch.Tensor:
        """Scores ``(C, len(TASKS))`` of candidates ``cand_items (C,)`` (jagged by ``cand_offsets (B + 1,)``, one
        sequence per user) against the users' cached histories, ``micro_batch`` candidates per user at a time
        (None: all). Each micro-batch is one delta call per layer; groups never see each other, so the scores
        equal ``forward(..., max_seq_len=cache.max_seq_len)`` whatever the micro-batch size.

        ``cuda_graphs``: replay CUDA graphs of the micro-batches (the same scores to rounding, a fraction of the
        host time), kept from one request to the next in ``graph_pool`` (default ``serving.graph_pool(self)``).
        Every micro-batch is padded to one shape (``serving.padded_width`` candidates a user), which runs eagerly
        the first time, is captured the second, and replays from then on, for any users and history lengths of
        the same buffer bucket (``serving.GraphPool``). None: on CUDA when a padded micro-batch has at most
        ``serving.GRAPH_MAX_ROWS`` new rows (small, host-bound micro-batches). True needs CUDA tensors.

        ``fp8``: attention in e4m3 (``flexhstu.quantize_fp8``): the gathered histories are quantized once per
        request (``serving.quantize_history``) and each micro-batch's rows as they come; the rest of the model
        runs in its dtype. Through CUDA graphs too: the pool keeps e4m3 buffers for them apart."""
        _check_eval(self)
        if len(users) != cand_offsets.numel() - 1:
            raise bad_value("users", f"one user per candidate sequence ({cand_offsets.numel() - 1})", len(users))
        batches = serving.micro_batches(cand_offsets, micro_batch, total=cand_items.shape[0])
        if cuda_graphs and not cand_items.is_cuda:
            raise bad_value(
                "cuda_graphs",
                "False or None for candidates on the CPU (CUDA graphs need CUDA tensors)",
                f"True with cand_items on {cand_items.device}",
            )
        if cuda_graphs:
            reason = self._no_graph_reason(cand_items.device, fp8)
            if reason:
                raise bad_value(
                    "cuda_graphs",
                    "False or None here (a captured micro-batch must run the Triton "
                    "kernels: the PyTorch reference reads sizes on the host)",
                    f"True, but {reason}",
                )
        # Room after each history for a micro-batch's rows: the histories are laid out once per request.
        widest = max((max(mb.counts) for mb in batches), default=0)
        room = self.group_size * widest
        # Host ints: a history and one micro-batch's rows over the cache's bound, named here (the delta call
        # would name a max_seq_len the caller never gave).
        lengths = [cache.length(user) for user in users]
        for b, length in enumerate(lengths):
            n = max((mb.counts[b] for mb in batches), default=0)
            if length + self.group_size * n > cache.max_seq_len:
                fits = max((cache.max_seq_len - length) // self.group_size, 0)
                raise bad_value(
                    "micro_batch",
                    f"at most {fits} candidates of user {users[b]!r} at a time (its "
                    f"history of {length} rows and {self.group_size} rows per candidate within the "
                    f"cache's max_seq_len {cache.max_seq_len})",
                    f"{micro_batch} ({n} at once)",
                )
        # Through the pool every micro-batch is padded to `width` candidates a user: one shape, one graph.
        width = serving.padded_width(widest, micro_batch, lengths, self.group_size, cache.max_seq_len)
        if cuda_graphs is None:
            cuda_graphs = (
                cand_items.is_cuda
                and bool(batches)
                and width is not None
                and self.group_size * width * len(users) <= serving.GRAPH_MAX_ROWS
                and self._no_graph_reason(cand_items.device, fp8) is None
            )
        if cuda_graphs and width is None:  # padded to one shape, some history would pass the cache's bound
            raise bad_value(
                "cuda_graphs",
                f"False or None for this request (every user's micro-batches padded to {widest} candidates "
                f"would take a history past the cache's max_seq_len {cache.max_seq_len})",
                True,
            )
        if not cuda_graphs:
            history = cache.gather(users, room=room)
            history = serving.quantize_history(history) if fp8 else history
            run = lambda items, mb: self.score_micro_batch(history, items, mb.counts_tensor, cache.max_seq_len)
            return self._score_batches(cand_items, batches, run)
        pool = serving.graph_pool(self) if graph_pool is None else graph_pool
        return self._score_through_pool(pool, cache, users, cand_items, batches, width, fp8)

    def _score_through_pool(self, pool, cache, users, cand_items, batches, width: int, fp8=False) -> torch.Tensor:
        """``score_cached``'s graph path: every micro-batch padded to ``width`` candidates a user, replayed."""
        with pool.request(self, cache, users, width, fp8) as padded:
            run = lambda items, mb: padded(items, mb.counts_tensor, mb.counts)
            return self._score_batches(cand_items, batches, run)

    def _score_batches(self, cand_items: torch.Tensor, batches: list, run) -> torch.Tensor:
        scores = self.head.bias.new_zeros(cand_items.shape[0], len(TASKS))
        for mb in batches:
            # A copy out of the micro-batch's scores: a replayed graph's output buffer is reused.
            scores = scores.index_copy(0, mb.index, run(cand_items[mb.index], mb))
        return scores

    def _no_graph_reason(self, device: torch.device, fp8: bool = False) -> str | None:
        """Why the delta calls of this model on ``device`` (in e4m3 with ``fp8``) would not run the Triton kernels
        (which capture in a CUDA graph; the reference syncs), or None."""
        cfg = self.stack.layers[0].cfg
        kernel = Kernel(cfg.kernel)
        if kernel not in (Kernel.AUTO, Kernel.TRITON):
            return f"the STU layers use {kernel}"
        dtype = torch.float8_e4m3fn if fp8 else self.head.bias.dtype
        q = torch.empty(0, cfg.num_heads, cfg.attention_dim, device=device, dtype=dtype)
        v = torch.empty(0, cfg.num_heads, cfg.hidden_dim, device=device, dtype=dtype)
        return triton_unsupported_reason(q, v, FixedRule(), 0.0)

    def score_micro_batch(
        self, history: JaggedHistory, cand_items: torch.Tensor, counts: list[int] | torch.Tensor, max_seq_len: int
    ) -> torch.Tensor:
        """Scores ``(c, len(TASKS))`` of ``cand_items (c,)``, ``counts[b]`` of them for user ``b`` of ``history``.
        Sync-free when ``counts`` is a device tensor (the exported program takes it so)."""
        g = self.group_size
        counts = torch.as_tensor(counts, dtype=torch.int64, device=cand_items.device)
        check_item_ids(cand_items, self.encoder.items, "cand_items")
        cand = self.encoder.items(cand_items)
        groups = torch.cat([cand[:, None], self.tokenizer.tasks.expand(cand.shape[0], g - 1, -1)], dim=1)
        new_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]) * g
        nt = counts * g
        if self.task_tokens:  # the new rows' columns alone (no column for the history, no host count of its rows)

            def rows(layout: serving.DeltaLayout) -> dict:
                return {"attn_func": masks.onerank_rows(*serving.new_row_coords(layout), g)[0][None]}

            mask = serving.NewRowsMask(rows)
        else:
            mask = serving.NewRowsMask(lambda layout: {"num_targets": nt})
        out, _, _ = serving.stack_delta(
            self.stack, groups.reshape(-1, cand.shape[1]), history, new_offsets, max_seq_len=max_seq_len, mask=mask
        )
        out = out.reshape(-1, g, cand.shape[1])
        z = out[:, 1:] if self.task_tokens else out[:, :1].expand(-1, len(TASKS), -1)
        return self.head(z)


def _check_eval(model: nn.Module) -> None:
    if model.training:
        raise RuntimeError(
            f"{type(model).__name__}: expected eval mode for cached scoring (call .eval(): the "
            "cache path has no dropout), got training mode"
        )
