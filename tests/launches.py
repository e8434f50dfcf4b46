"""Counting the Triton kernels that code launches, on the CPU: under ``TRITON_INTERPRET=1`` every launch, through
``kernel[grid](...)`` or ``fast_launch.Launcher``, runs ``InterpretedFunction.run`` once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
from triton import knobs


@contextmanager
def counted_launches() -> Iterator[Counter]:
    """Within the block, each launch adds one to its kernel's name in the yielded counter."""
    if not knobs.runtime.interpret:
        pytest.skip("counting launches needs Triton's interpreter (TRITON_INTERPRET=1)")
    from triton.runtime.interpreter import InterpretedFunction

    counts: Counter = Counter()
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        if not kwargs.get("warmup"):  # a warm-up launches nothing
            counts[self.__name__] += 1
        return run(self, *args, **kwargs)

    with mock.patch.object(InterpretedFunction, "run", counting):
        yield counts
