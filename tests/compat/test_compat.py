"""The generative-recommenders and TorchEasyRec entry points: their signatures, their documented leniencies,
and the same numbers as flexhstu.hstu_mha."""

from __future__ import annotations

import inspect
from enum import Enum

import pytest
import torch
from rules import dense_from_rule, offsets_from, sla_visible

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.compat import gr, tzrec
from flexhstu.compat._kernels import to_kernel

# The peers' parameter lists, in order (generative_recommenders/ops/hstu_attention.py,
# tzrec/ops/hstu_attention.py, tzrec/ops/hstu_attention_utils.py).
GR_PARAMS = [
    "max_seq_len",
    "alpha",
    "q",
    "k",
    "v",
    "seq_offsets",
    "causal",
    "dropout_pr",
    "training",
    "num_targets",
    "attn_scale",
    "max_attn_len",
    "contextual_seq_len",
    "min_full_attn_seq_len",
    "sort_by_length",
    "kernel",
    "enable_tma",
]
TZREC_PARAMS = [
    "max_seq_len",
    "alpha",
    "q",
    "k",
    "v",
    "seq_offsets",
    "causal",
    "dropout_pr",
    "training",
    "num_targets",
    "max_attn_len",
    "contextual_seq_len",
    "min_full_attn_seq_len",
    "sort_by_length",
    "kernel",
    "enable_tma",
    "attn_func",
    "scaling_seqlen",
]
SLA_PARAMS = ["nheads", "sla_k1", "sla_k2", "seq_offsets", "total_q", "num_targets", "contextual_seq_len", "device"]

LENGTHS = [6, 0, 9, 4]


def batch(seed=0, heads=2, d=16):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    return offsets_from(LENGTHS), *(torch.randn(total, heads, d, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize(
    "fn,params", [(gr.hstu_mha, GR_PARAMS), (tzrec.hstu_mha, TZREC_PARAMS), (tzrec.build_sla_func_tensor, SLA_PARAMS)]
)
def test_signatures_are_the_peers_in_order(fn, params):
    assert list(inspect.signature(fn).parameters) == params


def test_peer_defaults_are_kept():
    g, t = inspect.signature(gr.hstu_mha).parameters, inspect.signature(tzrec.hstu_mha).parameters
    assert g["kernel"].default == gr.HammerKernel.PYTORCH and t["kernel"].default == tzrec.Kernel.PYTORCH
    assert (g["causal"].default, g["dropout_pr"].default, g["training"].default) == (True, 0.0, True)
    assert (t["scaling_seqlen"].default, t["attn_func"].default, g["attn_scale"].default) == (-1, None, None)


def test_gr_attn_scale_is_the_eleventh_positional_argument():
    offs, q, k, v = batch()
    nt = torch.tensor([2, 0, 3, 1])
    scale = torch.linspace(0.1, 1.0, q.shape[0], dtype=torch.float64)
    got = gr.hstu_mha(9, 0.3, q, k, v, offs, True, 0.0, True, nt, scale, 2)
    want = flexhstu.hstu_mha(
        9, 0.3, q, k, v, offs, num_targets=nt, max_attn_len=2, attn_scale=scale, kernel=Kernel.PYTORCH
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, gr.hstu_mha(9, 0.3, q, k, v, offs, True, 0.0, True, nt, None, 2))


def test_gr_performance_hints_change_nothing():
    offs, q, k, v = batch(1)
    base = gr.hstu_mha(9, None, q, k, v, offs)
    hinted = gr.hstu_mha(9, None, q, k, v, offs, sort_by_length=True, enable_tma=True)
    torch.testing.assert_close(base, hinted, rtol=0, atol=0)
    torch.testing.assert_close(base, flexhstu.hstu_mha(9, None, q, k, v, offs), rtol=0, atol=0)


def test_tzrec_ignores_fixed_rule_arguments_next_to_attn_func():
    offs, q, k, v = batch(2)
    func = masks.sla(offs, 3, 2)
    nt = torch.tensor([1, 0, 2, 1])
    got = tzrec.hstu_mha(9, None, q, k, v, offs, False, 0.0, True, nt, 4, 2, 1, attn_func=func, scaling_seqlen=5)
    want = flexhstu.hstu_mha(9, None, q, k, v, offs, attn_func=func, scaling_seqlen=5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="attn_func: the func alone decides visibility"):
        flexhstu.hstu_mha(9, None, q, k, v, offs, num_targets=nt, attn_func=func)  # the strict API refuses


def test_tzrec_clamps_targets_longer_than_a_sequence_to_the_sequence():
    offs, q, k, v = batch(3)
    too_many = torch.tensor([8, 3, 20, 1], dtype=torch.int32)
    got = tzrec.hstu_mha(9, None, q, k, v, offs, num_targets=too_many, contextual_seq_len=1)
    want = flexhstu.hstu_mha(9, None, q, k, v, offs, num_targets=torch.tensor([6, 0, 9, 1]), contextual_seq_len=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"num_targets\[0\]: expected 0 <= T <= the sequence length 6, got 8"):
        flexhstu.hstu_mha(9, None, q, k, v, offs, num_targets=too_many)


def test_tzrec_sla_builder_follows_the_sla_rule_with_clamped_targets():
    offs = offsets_from(LENGTHS, dtype=torch.int32)
    nt = torch.tensor([2, 1, 12, 0])
    func = tzrec.build_sla_func_tensor(3, 2, 1, offs, sum(LENGTHS), nt, 2, device="cpu")
    assert func.shape == (3, 3, sum(LENGTHS)) and func.dtype == torch.int32 and func.stride(0) == 0
    clamped = [min(t, L) for t, L in zip(nt.tolist(), LENGTHS)]
    want = dense_from_rule(LENGTHS, 9, lambda b, i, j, L: sla_visible(i, j, L, clamped[b], 2, 1, 2))
    assert torch.equal(masks.to_dense(func, offs, 9), want.expand(-1, 3, -1, -1))


class _ForeignKernel(Enum):  # a peer's enum that flexhstu has never imported
    TRITON_CC = "whatever"
    CUTLASS = 7


@pytest.mark.parametrize(
    "given,want",
    [
        (gr.HammerKernel.PYTORCH, Kernel.PYTORCH),
        (gr.HammerKernel.TRITON_CC, Kernel.TRITON),
        (gr.HammerKernel.CUDA, Kernel.CUTLASS),
        (tzrec.Kernel.CUTLASS, Kernel.CUTLASS),
        (tzrec.Kernel.TRITON, Kernel.TRITON),
        (_ForeignKernel.TRITON_CC, Kernel.TRITON),
        (_ForeignKernel.CUTLASS, Kernel.CUTLASS),
        ("TRITON_INFERENCE", Kernel.TRITON),
        ("PYTORCH", Kernel.PYTORCH),
        ("auto", Kernel.AUTO),
        (Kernel.TRITON, Kernel.TRITON),
    ],
)
def test_peer_kernel_enums_and_names_map_to_ours(given, want):
    assert to_kernel(given) is want


@pytest.mark.parametrize("bad", ["FAST", 3, None])
def test_an_unknown_kernel_is_a_named_error(bad):
    offs, q, k, v = batch()
    with pytest.raises(ValueError, match=r"kernel: expected a kernel enum member or name, one of \['AUTO', "):
        gr.hstu_mha(9, None, q, k, v, offs, kernel=bad)


def test_a_peer_kernel_choice_reaches_the_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    offs, q, k, v = batch()
    with pytest.raises(RuntimeError, match="CUTLASS"):
        tzrec.hstu_mha(9, None, q, k, v, offs, kernel=tzrec.Kernel.CUTLASS)
    with pytest.raises(ValueError, match=r"q.device: expected CUDA for Kernel\.TRITON"):
        gr.hstu_mha(9, None, q.float(), k.float(), v.float(), offs, kernel=gr.HammerKernel.TRITON)


def test_tzrec_clamps_small_integer_targets_without_wrapping():
    # Clamped in int64: lengths cast to uint8 would wrap (256 -> 0), and 5 targets on a 256-row sequence become 0.
    offs = torch.tensor([0, 256, 260])
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        got = tzrec._clamped_targets(torch.tensor([5, 1], dtype=dtype), offs)
        assert got.tolist() == [5, 1], dtype
    assert tzrec._clamped_targets(torch.tensor([300, 9]), offs).tolist() == [256, 4]
