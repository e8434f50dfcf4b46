"""Serving: a per-user K/V cache of the STU stack and candidate scoring against it (docs/design.md, section 8)."""

from .cache import HistoryCache, JaggedHistory, UserHistory
from .delta_stack import DeltaLayout, delta_layout, extend, layer_delta, prefill, stack_delta
from .export import MicroBatchScorer, ScorerInputs, compile_scorer, export_scorer
from .graphs import GRAPH_MAX_ROWS, MicroBatchGraphs
from .scoring import MicroBatch, micro_batches

__all__ = [
    "GRAPH_MAX_ROWS",
    "DeltaLayout",
    "HistoryCache",
    "JaggedHistory",
    "MicroBatch",
    "MicroBatchGraphs",
    "MicroBatchScorer",
    "ScorerInputs",
    "UserHistory",
    "compile_scorer",
    "delta_layout",
    "export_scorer",
    "extend",
    "layer_delta",
    "micro_batches",
    "prefill",
    "stack_delta",
]
