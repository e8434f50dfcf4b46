"""Models: HSTU sequential retrieval (and its SASRec-style and popularity baselines), OneRank ranking."""

from .ranking import OneRankModel, RankingRequests, make_requests
from .retrieval import HSTURetrieval, Popularity, SASRecRetrieval, SeqBatch, make_batch

__all__ = ["HSTURetrieval", "OneRankModel", "Popularity", "RankingRequests", "SASRecRetrieval", "SeqBatch",
           "make_batch", "make_requests"]
