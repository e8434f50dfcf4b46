"""Shared test helpers: jagged batches and independent, element-by-element mask rules.

The rules here are written from docs/design.md, section 3, one (query, key) pair at a
time, with no code shared with flexhstu.masks, so a builder is checked against
an independent reading of the specification.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=25, deadline=None)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _skipped_for_the_interpreter(item: pytest.Item) -> bool:
    """Whether ``item`` carries a true skipif whose reason is the missing ``TRITON_INTERPRET=1``."""
    return any(
        mark.args and mark.args[0] is True and "TRITON_INTERPRET" in mark.kwargs.get("reason", "")
        for mark in item.iter_markers(name="skipif")
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA the Triton kernel tests run only under ``TRITON_INTERPRET=1``. Forgetting it skipped them all
    (127 in the whole suite) and the run still passed, so the collection stops instead, saying why."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if torch.cuda.is_available():
        return
    kernel_tests = [item for item in items if _skipped_for_the_interpreter(item)]
    if kernel_tests:
        raise pytest.UsageError(
            f"no CUDA device and TRITON_INTERPRET is not 1: {len(kernel_tests)} Triton kernel test(s) would be "
            "skipped; run `TRITON_INTERPRET=1 python -m pytest ...` (the README's test command sets it)"
        )
