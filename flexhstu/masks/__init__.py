"""The func format: builders, validation, dense <-> intervals, pictures."""

from .builders import causal, fixed, onerank, onerank_rows, sla
from .format import HSTU_ARBITRARY_NFUNC, count_visible, from_dense, num_intervals, to_dense, validate, widen
from .rules import dense_fixed

__all__ = [
    "HSTU_ARBITRARY_NFUNC",
    "causal",
    "count_visible",
    "dense_fixed",
    "fixed",
    "from_dense",
    "num_intervals",
    "onerank",
    "onerank_rows",
    "sla",
    "to_dense",
    "validate",
    "widen",
]
