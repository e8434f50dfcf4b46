"""Drop-in entry points for generative-recommenders and TorchEasyRec callers (docs/design.md, section 8).

``hstu_mha`` and ``delta_hstu_mha`` of ``flexhstu.compat.gr`` and ``flexhstu.compat.tzrec`` take their peer's
exact positional and keyword arguments; ``flexhstu.compat.tzrec.build_sla_func_tensor`` takes tzrec's. Each
translates the call and runs ``flexhstu.hstu_mha`` / ``flexhstu.delta_hstu_mha`` / ``flexhstu.masks``: there is
no second implementation here.
"""

from . import gr, tzrec

__all__ = ["gr", "tzrec"]
