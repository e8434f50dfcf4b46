"""Interaction data: MovieLens readers, a synthetic generator, Parquet caching, sequence splits."""

from .movielens import Interactions, data_digest, load, synthetic
from .sequences import UserSequences, leave_one_out

__all__ = ["Interactions", "UserSequences", "data_digest", "leave_one_out", "load", "synthetic"]
