"""Serving: a per-user K/V cache of the STU stack and candidate scoring against it (docs/design.md, section 8)."""

from .cache import HistoryCache, JaggedHistory, UserHistory, quantize_history
from .delta_stack import (
    DeltaLayout,
    NewRowsMask,
    delta_layout,
    extend,
    layer_delta,
    new_row_coords,
    prefill,
    stack_delta,
)
from .export import MicroBatchScorer, ScorerInputs, compile_scorer, export_scorer
from .graphs import (
    GRAPH_MAX_ROWS,
    GraphPool,
    MicroBatchGraphs,
    capacity_bucket,
    graph_pool,
    padded_width,
)
from .scoring import MicroBatch, micro_batches

__all__ = [
    "GRAPH_MAX_ROWS",
    "DeltaLayout",
    "GraphPool",
    "HistoryCache",
    "JaggedHistory",
    "MicroBatch",
    "MicroBatchGraphs",
    "MicroBatchScorer",
    "NewRowsMask",
    "ScorerInputs",
    "UserHistory",
    "capacity_bucket",
    "compile_scorer",
    "delta_layout",
    "export_scorer",
    "extend",
    "graph_pool",
    "layer_delta",
    "micro_batches",
    "new_row_coords",
    "padded_width",
    "prefill",
    "quantize_history",
    "stack_delta",
]
