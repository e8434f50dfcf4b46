"""A trained model's settings as one typed record, ``ModelConfig``, and ``build_model``, which makes the model.

``flexhstu train`` makes the record from its options and ``flexhstu recommend`` from the configuration a
checkpoint saved; the fields carry the options' names, as a checkpoint records them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from torch import nn

from .ranking import OneRankModel
from .retrieval import HSTURetrieval, SASRecRetrieval


@dataclass(frozen=True)
class ModelConfig:
    """What decides a model's architecture: ``model`` is ``hstu``, ``sasrec`` or ``onerank``; ``mask``, ``sla_k1``,
    ``sla_k2`` and ``no_rel_bias`` are read by hstu only, ``no_task_tokens`` by onerank only."""

    model: str
    dim: int
    layers: int
    heads: int
    max_len: int
    dropout: float
    mask: str
    sla_k1: int
    sla_k2: int
    no_rel_bias: bool
    no_task_tokens: bool

    @classmethod
    def from_settings(cls, settings: Mapping) -> ModelConfig:
        """The record of a run's ``settings`` (its options as a dict, or a checkpoint's saved configuration), which
        must hold every field; other keys are left out."""
        return cls(**{f.name: settings[f.name] for f in fields(cls)})


def build_model(config: ModelConfig, num_items: int, items: nn.Module | None = None) -> nn.Module:
    """The model of ``config`` over ``num_items`` items; ``items`` is its item table module (default a new
    ``nn.Embedding``)."""
    c = config
    if c.model == "hstu":
        return HSTURetrieval(
            num_items,
            dim=c.dim,
            layers=c.layers,
            heads=c.heads,
            max_len=c.max_len,
            mask=c.mask,
            sla_k1=c.sla_k1,
            sla_k2=c.sla_k2,
            dropout=c.dropout,
            rel_bias=not c.no_rel_bias,
            items=items,
        )
    if c.model == "sasrec":
        return SASRecRetrieval(
            num_items, dim=c.dim, layers=c.layers, heads=c.heads, max_len=c.max_len, dropout=c.dropout, items=items
        )
    return OneRankModel(
        num_items,
        dim=c.dim,
        layers=c.layers,
        heads=c.heads,
        max_len=c.max_len,
        task_tokens=not c.no_task_tokens,
        dropout=c.dropout,
        items=items,
    )
