"""One predicate says what Triton can run: AUTO falls back on it, TRITON raises with it."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.masks.rules import FixedRule
from flexhstu.ops.bias import RelativeBias
from flexhstu.ops.capability import triton_unsupported_reason

triton = pytest.importorskip("triton")
hstu_mha_module = importlib.import_module("flexhstu.ops.hstu_mha")

LENGTHS = [5, 3]


def qkv(dqk=16, dv=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 2, dqk, generator=g, dtype=dtype)
    return q, torch.randn(8, 2, dqk, generator=g, dtype=dtype), torch.randn(8, 2, dv, generator=g, dtype=dtype)


UNSUPPORTED = {
    "float64": (dict(dtype=torch.float64), {}, r"q.dtype: expected float16, bfloat16 or float32 .*got torch.float64"),
    # The interpreter's bfloat16 dots are wrong (outputs near 1e9 where the reference gives 0.6).
    "bfloat16 on the CPU": (
        dict(dtype=torch.bfloat16),
        {},
        r"q.dtype: expected float16 or float32 for Kernel.TRITON "
        r"on the CPU .*got torch.bfloat16",
    ),
    "dqk-300": (dict(dqk=300), {}, r"q.shape\[2\] \(Dqk\): expected a head dim from 1 to 256 .*got 300"),
    "dv-512": (dict(dv=512), {}, r"v.shape\[2\] \(Dv\): expected a head dim from 1 to 256 .*got 512"),
    "dropout": ({}, dict(dropout_pr=0.2), r"dropout_pr: expected 0.0 \(or training=False\) .*got 0.2"),
    "non-causal-targets": (
        {},
        dict(causal=False, num_targets=torch.tensor([1, 1])),
        r"causal: expected True with num_targets",
    ),
    "attn-scale-grad": (
        {},
        dict(attn_scale=torch.full((8,), 0.5, requires_grad=True)),
        r"attn_scale: expected a tensor that does not",
    ),
    "non-causal-window": ({}, dict(causal=False, max_attn_len=2), r"causal: expected True with max_attn_len"),
    "non-causal-contextual": (
        {},
        dict(causal=False, contextual_seq_len=1),
        r"causal: expected True with contextual_seq_len",
    ),
}


def rule_rate_and_scale(kw):
    kw = dict(kw)
    rate = kw.pop("dropout_pr", 0.0)
    scale = kw.pop("attn_scale", None)
    bias = kw.pop("rel_bias", kw.pop("rab", None))
    return FixedRule(**kw), rate, scale, bias


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_predicate_names_the_unsupported_argument(name, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shape_kw, call_kw, msg = UNSUPPORTED[name]
    q, _, v = qkv(**shape_kw)
    rule, rate, scale, bias = rule_rate_and_scale(call_kw)
    reason = triton_unsupported_reason(q, v, rule, rate, attn_scale=scale, bias=bias)
    assert reason is not None and re.search(msg, reason), reason


@pytest.mark.parametrize(
    "shape_kw,call_kw",
    [
        ({}, {}),
        (dict(dqk=24, dv=256, dtype=torch.float16), {}),
        ({}, dict(causal=False, min_full_attn_seq_len=3)),
        ({}, dict(num_targets=torch.tensor([1, 1]), max_attn_len=2, contextual_seq_len=1)),
    ],
)
def test_predicate_accepts_what_triton_runs(shape_kw, call_kw, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, _, v = qkv(**shape_kw)
    assert triton_unsupported_reason(q, v, FixedRule(**call_kw), 0.0) is None
    assert triton_unsupported_reason(q, v, masks.causal(offsets_from(LENGTHS)), 0.0) is None
    assert triton_unsupported_reason(q, v, FixedRule(**call_kw), 0.0, attn_scale=torch.full((8,), 0.5)) is None
    # The relative bias runs in the kernels, from its tables or dense.
    tables = RelativeBias(torch.zeros(9), torch.zeros(129), torch.arange(8))
    assert triton_unsupported_reason(q, v, FixedRule(**call_kw), 0.0, bias=tables) is None
    assert triton_unsupported_reason(q, v, FixedRule(**call_kw), 0.0, bias=torch.zeros(2, 5, 5)) is None


def test_predicate_wants_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, _, v = qkv()
    assert "q.device: expected CUDA" in triton_unsupported_reason(q, v, FixedRule(), 0.0)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_explicit_triton_raises_with_the_reason(name, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shape_kw, call_kw, msg = UNSUPPORTED[name]
    q, k, v = qkv(**shape_kw)
    with pytest.raises(ValueError, match=msg):
        flexhstu.hstu_mha(5, None, q, k, v, offsets_from(LENGTHS), kernel=Kernel.TRITON, **call_kw)


def test_auto_on_cpu_runs_the_reference_even_where_triton_could(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def refuse(call):
        raise AssertionError("AUTO chose Triton for a CPU tensor")

    monkeypatch.setitem(hstu_mha_module._BACKENDS, Kernel.TRITON, refuse)
    q, k, v = qkv()
    offs = offsets_from(LENGTHS)
    auto = flexhstu.hstu_mha(5, None, q, k, v, offs)
    torch.testing.assert_close(auto, flexhstu.hstu_mha(5, None, q, k, v, offs, kernel=Kernel.PYTORCH), rtol=0, atol=0)
