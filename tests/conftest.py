"""Shared test helpers: jagged batches and independent, element-by-element mask rules.

The rules here are written from docs/design.md, section 3, one (query, key) pair at a
time, with no code shared with flexhstu.masks, so a builder is checked against
an independent reading of the specification.
"""

from __future__ import annotations

import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=25, deadline=None)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
