"""Models: HSTU sequential retrieval (and its SASRec-style and popularity baselines), OneRank ranking."""

from .build import ModelConfig, build_model
from .ranking import OneRankModel, RankingRequests, make_requests
from .retrieval import HSTURetrieval, Popularity, SASRecRetrieval, SeqBatch, make_batch

__all__ = [
    "HSTURetrieval",
    "ModelConfig",
    "OneRankModel",
    "Popularity",
    "RankingRequests",
    "SASRecRetrieval",
    "SeqBatch",
    "build_model",
    "make_batch",
    "make_requests",
]
