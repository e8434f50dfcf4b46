"""Model layers: STU layer and stack, relative attention bias, input encoding, OneRank tokenizer and head."""

from .encoding import InputEncoder, time_gap_buckets
from .learned_bias import RelativeTimePositionBias
from .onerank import OneRankBatch, OneRankHead, OneRankTokenizer, onerank_loss
from .stu import STULayer, STULayerConfig, STUStack

__all__ = [
    "InputEncoder",
    "OneRankBatch",
    "OneRankHead",
    "OneRankTokenizer",
    "RelativeTimePositionBias",
    "STULayer",
    "STULayerConfig",
    "STUStack",
    "onerank_loss",
    "time_gap_buckets",
]
