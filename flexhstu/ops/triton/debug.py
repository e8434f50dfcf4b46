"""Debug tools for the Triton kernels; nothing here is needed to use them.

``poison_outputs()`` fills every output and gradient buffer with NaN before
the kernels run, so an element that no kernel writes shows up as NaN instead of
whatever the allocator left there (the tests run every kernel this way)::

    with flexhstu.ops.triton.debug.poison_outputs():
        out = hstu_mha(...)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_POISON = ContextVar("flexhstu_triton_poison_outputs", default=False)


@contextmanager
def poison_outputs() -> Iterator[None]:
    """Within the block, Triton outputs start as NaN (one extra fill per output: slower, for tests)."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


def poisoning() -> bool:
    """True inside ``poison_outputs()``."""
    return _POISON.get()
