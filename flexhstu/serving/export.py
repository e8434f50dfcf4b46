"""One candidate micro-batch as an exportable module (``torch.export``), and its AOTInductor package.

``MicroBatchScorer`` is the module; :func:`export_scorer` exports it with the request's sizes (users,
history rows, candidates) dynamic; :func:`compile_scorer` compiles the export with AOTInductor into a
``.pt2`` package and loads it back. The attention runs in the graph as the ``flexhstu::`` custom ops
(Triton) or as the reference's PyTorch operations (``Kernel.PYTORCH``): the custom ops have fake
implementations for tracing, and the compiled package calls them through AOTInductor's fallback for
custom ops, so the process that runs the package must have imported flexhstu (which registers them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.fx.experimental._config  # backed_size_oblivious (see export_scorer)
from torch import nn

from .._errors import bad_type, bad_value
from .cache import JaggedHistory


class MicroBatchScorer(nn.Module):
    """``forward(ks, vs, hist_offsets, cand_items, counts) -> (c, tasks)`` scores of one micro-batch.

    ``ks``, ``vs``: per-layer cached history ``k (T_h, H, Dqk)``, ``v (T_h, H, Dv)`` (``HistoryCache.gather``);
    ``hist_offsets (B + 1,)``; ``cand_items (c,)``; ``counts (B,)`` candidates per user. Runs under no_grad,
    reads no tensor on the host, so ``torch.export.export(scorer, args)`` traces it (the custom ops carry fakes).
    """

    def __init__(self, model: nn.Module, max_seq_len: int):
        super().__init__()
        self.model, self.max_seq_len = model, max_seq_len

    def forward(
        self,
        ks: tuple[torch.Tensor, ...],
        vs: tuple[torch.Tensor, ...],
        hist_offsets: torch.Tensor,
        cand_items: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        with torch.no_grad():
            history = JaggedHistory(list(ks), list(vs), hist_offsets, [])
            return self.model.score_micro_batch(history, cand_items, counts, self.max_seq_len)


class ScorerInputs(NamedTuple):
    """The arguments of ``MicroBatchScorer.forward``, in order: per-layer history keys ``ks`` and values ``vs``
    (``(T_h, H, D)`` each), ``hist_offsets (B + 1,)``, ``cand_items (c,)`` and ``counts (B,)`` (int64)."""

    ks: tuple[torch.Tensor, ...]
    vs: tuple[torch.Tensor, ...]
    hist_offsets: torch.Tensor
    cand_items: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, history: JaggedHistory, cand_items: torch.Tensor, counts: torch.Tensor) -> ScorerInputs:
        """The inputs for ``cand_items (c,)`` (``counts (B,)`` per user) against a gathered ``history``."""
        if history.room:
            raise bad_value(
                "history",
                "a history gathered without room (cache.gather(users)): the scorer reads "
                "every row of k and v as history",
                f"room={history.room}",
            )
        return cls(tuple(history.k), tuple(history.v), history.offsets, cand_items, counts)


def scorer_dynamic_shapes(inputs: ScorerInputs) -> tuple:
    """``torch.export`` dynamic shapes of the inputs: the users ``B``, the history rows ``T_h`` (the same in
    every layer's K and V) and the candidates ``c`` vary; heads and head dims are fixed."""
    users = torch.export.Dim("users", min=1)
    hist_rows = torch.export.Dim("hist_rows", min=1)
    cands = torch.export.Dim("cands", min=1)
    per_layer = tuple({0: hist_rows} for _ in inputs.ks)
    return per_layer, per_layer, {0: users + 1}, {0: cands}, {0: users}


def export_scorer(
    scorer: MicroBatchScorer, example: ScorerInputs, *, dynamic: bool = True
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``scorer`` traced on ``example``; with ``dynamic`` any number of users, history rows and
    candidates runs (the example then needs at least 2 of each: export specialises sizes 0 and 1)."""
    if not isinstance(example, ScorerInputs):
        raise bad_type(
            "example", "a ScorerInputs (ScorerInputs.of(history, cand_items, counts))", type(example).__name__
        )
    sizes = {
        "users": example.counts.shape[0],
        "history rows": example.ks[0].shape[0] if example.ks else 0,
        "candidates": example.cand_items.shape[0],
    }
    if dynamic and min(sizes.values()) < 2:
        got = ", ".join(f"{n} {k}" for k, n in sizes.items())
        raise bad_value(
            "example",
            "at least 2 users, 2 history rows and 2 candidates for dynamic shapes "
            "(torch.export specialises sizes 0 and 1)",
            got,
        )
    if not dynamic:
        return torch.export.export(scorer, tuple(example))
    # Size-oblivious: broadcasting and contiguity checks on a symbolic size (the users' diff of offsets, an
    # arange over them) would otherwise add a guard "at least 2 users" that the module checks when called,
    # though the graph is the same for one user.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(scorer, tuple(example), dynamic_shapes=scorer_dynamic_shapes(example))


def compile_scorer(
    scorer: MicroBatchScorer,
    example: ScorerInputs,
    package_path: str | Path,
    *,
    dynamic: bool = True,
    inductor_configs: dict | None = None,
) -> Callable[..., torch.Tensor]:
    """Export ``scorer`` (:func:`export_scorer`), compile it with AOTInductor into ``package_path`` (a ``.pt2``
    file, written) and load it: returns the compiled scorer, called as the module is (``compiled(*inputs)``,
    scores ``(c, tasks)``), on the device and dtype of the example. ``inductor_configs``: passed to
    ``torch._inductor.aoti_compile_and_package``."""
    path = Path(package_path)
    if path.suffix != ".pt2":
        raise bad_value("package_path", "a file name ending in .pt2 (AOTInductor's package)", str(package_path))
    import torch._inductor  # AOTInductor: imported when asked for (a heavy import)

    program = export_scorer(scorer, example, dynamic=dynamic)
    configs = dict(inductor_configs or {})  # a copy: the compiler adds its own entries to the dict it is given
    written = torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    return torch._inductor.aoti_load_package(written)
