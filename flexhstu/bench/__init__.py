"""Benchmarks: what ``flexhstu bench`` runs, one module per benchmark.

* ``attention``: ``hstu_mha`` (Triton) against FlexAttention and SDPA on the same shapes and masks;
* ``stu_step``: the STU stack's forward + backward step, time and peak memory per layer variant
  (``flexhstu bench --model-step``);
* ``serving``: cached delta scoring against a full recompute, the delta kernel, AOTInductor
  (``flexhstu bench --serving``); its parts are measured in ``serving_scoring``, ``serving_kernel`` and
  ``serving_aoti``, on the model and inputs of ``serving_setup``.

Measurement lives in those modules, the markdown tables in ``report``, the timing helpers they share in
``timing``. Each module runs as ``python -m flexhstu.bench.<name>`` with the options of its
``flexhstu bench`` form; the submodules are imported on demand, so ``import flexhstu.bench`` stays cheap.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``flexhstu bench [--model-step | --serving] ...``: the attention benchmark, or the one the flag names (the
    flag is dropped; the benchmark parses the rest). ``attention.main`` hands ``--model-step`` on itself, so its
    ``--help`` lists the option."""
    argv = list(argv) if argv is not None else None
    if argv is not None and "--serving" in argv:
        from . import serving

        return serving.main([x for x in argv if x != "--serving"])
    from . import attention

    return attention.main(argv)
