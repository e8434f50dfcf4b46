"""The settings a run's checkpoint records, and ``saved_config``, the one check of a loaded checkpoint's record
that ``flexhstu train --resume`` and ``flexhstu recommend`` share.

Apart from the training command so that ``recommend`` reads a run without importing it: this module imports
nothing of flexhstu.
"""

from __future__ import annotations

import os

FIXED_ON_RESUME = (
    "task",
    "model",
    "data",
    "columns",
    "mask",
    "sla_k1",
    "sla_k2",
    "no_rel_bias",
    "no_task_tokens",
    "dim",
    "layers",
    "heads",
    "max_len",
    "dropout",
    "negatives",
    "batch_size",
    "seed",
    "synthetic_users",
    "synthetic_items",
    "synthetic_len",
    "steps_per_epoch",
    "eval_users",
    "shard_embeddings",
)
"""Arguments that define the model, its data or its sample streams: ``--resume`` refuses a change to any of
them, since the resumed run would silently become a different experiment. ``--shard-embeddings`` decides the
checkpoint's format, so it stays too; the number of ranks may change."""

CONFIG_ALWAYS_RECORDED = (
    "task",
    "model",
    "data",
    "mask",
    "sla_k1",
    "sla_k2",
    "no_task_tokens",
    "dim",
    "layers",
    "heads",
    "max_len",
    "dropout",
    "negatives",
    "batch_size",
    "seed",
    "data_rows",
    "num_items",
    "lr",
    "epochs",
)
"""The settings every flexhstu checkpoint has recorded; the others of ``FIXED_ON_RESUME`` came later."""

BEFORE_ADDED = {
    "columns": None,
    "no_rel_bias": False,
    "synthetic_users": None,
    "synthetic_items": None,
    "synthetic_len": None,
    "steps_per_epoch": 0,
    "eval_users": 0,
    "shard_embeddings": "none",
}
"""What a run had for each setting of ``FIXED_ON_RESUME`` that came later, before it existed: the option's
default (no column names, the relative bias on, every batch, every user, one whole item table)."""

SYNTHETIC_DEFAULTS = {"synthetic_users": 300, "synthetic_items": 200, "synthetic_len": 40}
"""The sizes of ``--data synthetic`` when not given (a run records them; older runs recorded None)."""


def saved_config(state: dict, path: str | os.PathLike) -> dict:
    """The run settings of a loaded checkpoint ``state``, as the training command records them, for ``--resume``
    and ``flexhstu recommend`` alike. A setting added since the checkpoint was written had its default then
    (``BEFORE_ADDED``); one that every checkpoint records is required (``ValueError`` naming ``path`` and the key)."""
    config = state["config"]
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: not a complete flexhstu run checkpoint (its configuration is a "
            f"{type(config).__name__}, not a dict)"
        )
    missing = [k for k in CONFIG_ALWAYS_RECORDED if k not in config]
    if missing:
        raise ValueError(f"{path}: not a complete flexhstu run checkpoint (its configuration lacks '{missing[0]}')")
    return {**{k: BEFORE_ADDED.get(k) for k in FIXED_ON_RESUME}, "data_digest": None, **config}
