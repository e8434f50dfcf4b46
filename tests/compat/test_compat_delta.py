"""The peers' ``delta_hstu_mha``: their signatures, their convention (the last ``delta_q.shape[0] // B`` rows of
every sequence are the queries), the rows of a full ``flexhstu.hstu_mha`` call, and their errors."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rules import offsets_from

import flexhstu
from flexhstu import Kernel
from flexhstu.compat import gr, tzrec

# generative_recommenders/ops/hstu_attention.py and tzrec/ops/hstu_attention.py, in order.
GR_DELTA_PARAMS = [
    "max_seq_len",
    "alpha",
    "delta_q",
    "k",
    "v",
    "seq_offsets",
    "num_targets",
    "max_attn_len",
    "contextual_seq_len",
    "kernel",
    "enable_tma",
]
TZREC_DELTA_PARAMS = GR_DELTA_PARAMS + ["scaling_seqlen"]

LENGTHS = [6, 3, 9, 4]


def whole_sequences(lengths=LENGTHS, seed=0, heads=2, dqk=8, dv=6):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, dqk, generator=g, dtype=torch.float64) for _ in range(2))
    return offsets_from(lengths), q, k, torch.randn(total, heads, dv, generator=g, dtype=torch.float64)


def last_rows(lengths, delta):
    """Jagged rows of the last ``delta`` rows of every sequence, sequence by sequence."""
    offs = offsets_from(lengths)
    return torch.cat([torch.arange(int(offs[b + 1]) - delta, int(offs[b + 1])) for b in range(len(lengths))])


@pytest.mark.parametrize(
    "fn,params", [(gr.delta_hstu_mha, GR_DELTA_PARAMS), (tzrec.delta_hstu_mha, TZREC_DELTA_PARAMS)]
)
def test_delta_signatures_are_the_peers_in_order(fn, params):
    assert list(inspect.signature(fn).parameters) == params


def test_delta_peer_defaults_are_kept():
    g, t = inspect.signature(gr.delta_hstu_mha).parameters, inspect.signature(tzrec.delta_hstu_mha).parameters
    assert g["kernel"].default == gr.HammerKernel.PYTORCH and t["kernel"].default == tzrec.Kernel.PYTORCH
    for p in (g, t):
        assert (
            p["num_targets"].default,
            p["max_attn_len"].default,
            p["contextual_seq_len"].default,
            p["enable_tma"].default,
        ) == (None, 0, 0, False)
    assert t["scaling_seqlen"].default == -1


SETTINGS = {
    "causal": {},
    "targets": dict(num_targets=torch.tensor([2, 3, 1, 0])),
    "window": dict(max_attn_len=2),
    "contextual": dict(contextual_seq_len=2),
    "targets, window, contextual": dict(num_targets=torch.tensor([2, 1, 3, 2]), max_attn_len=3, contextual_seq_len=1),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("peer", [gr, tzrec])
def test_delta_rows_are_the_last_rows_of_a_full_call(peer, name):
    offs, q, k, v = whole_sequences()
    rows = last_rows(LENGTHS, 3)
    full = flexhstu.hstu_mha(12, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **SETTINGS[name])
    got = peer.delta_hstu_mha(12, 0.3, q[rows], k, v, offs, **SETTINGS[name])
    torch.testing.assert_close(got, full[rows], rtol=1e-12, atol=1e-12)


@given(
    lengths=st.lists(st.integers(0, 10), min_size=1, max_size=4),
    data=st.data(),
    window=st.integers(0, 4),
    contextual=st.integers(0, 3),
    with_targets=st.booleans(),
)
def test_delta_rows_equal_the_full_rows_for_any_lengths_and_rule(lengths, data, window, contextual, with_targets):
    delta = data.draw(st.integers(0, min(lengths)), label="delta")
    targets = [data.draw(st.integers(0, L), label="target") for L in lengths]
    kw = dict(
        num_targets=torch.tensor(targets) if with_targets else None, max_attn_len=window, contextual_seq_len=contextual
    )
    offs, q, k, v = whole_sequences(lengths)
    n = max(lengths)
    rows = last_rows(lengths, delta)
    full = flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.PYTORCH, **kw)
    positional = (kw["num_targets"], window, contextual)
    torch.testing.assert_close(
        gr.delta_hstu_mha(n, None, q[rows], k, v, offs, *positional), full[rows], rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        tzrec.delta_hstu_mha(n, None, q[rows], k, v, offs, *positional), full[rows], rtol=1e-12, atol=1e-12
    )


def test_tzrec_delta_scales_by_scaling_seqlen_and_clamps_targets():
    offs, q, k, v = whole_sequences(seed=1)
    rows = last_rows(LENGTHS, 2)
    clamped = torch.tensor([6, 3, 9, 1])
    full = flexhstu.hstu_mha(12, None, q, k, v, offs, num_targets=clamped, scaling_seqlen=5, kernel=Kernel.PYTORCH)
    too_many = torch.tensor([8, 3, 20, 1])
    got = tzrec.delta_hstu_mha(12, None, q[rows], k, v, offs, too_many, scaling_seqlen=5)
    torch.testing.assert_close(got, full[rows], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"num_targets\[0\]: expected 0 <= T <= the sequence length 6, got 8"):
        gr.delta_hstu_mha(12, None, q[rows], k, v, offs, too_many)  # GR's entry point does not clamp


def test_delta_performance_hint_changes_nothing():
    offs, q, k, v = whole_sequences(seed=2)
    rows = last_rows(LENGTHS, 3)
    base = gr.delta_hstu_mha(12, None, q[rows], k, v, offs)
    torch.testing.assert_close(gr.delta_hstu_mha(12, None, q[rows], k, v, offs, enable_tma=True), base, rtol=0, atol=0)
    torch.testing.assert_close(
        tzrec.delta_hstu_mha(12, None, q[rows], k, v, offs, enable_tma=True), base, rtol=0, atol=0
    )


@pytest.mark.parametrize("peer", [gr, tzrec])
def test_delta_rows_that_do_not_fill_every_sequence_equally_are_a_named_error(peer):
    offs, q, k, v = whole_sequences()
    with pytest.raises(
        ValueError,
        match=r"delta_q.shape\[0\]: expected a multiple of the batch size 4 \(last rows "
        r"of each sequence\), got 7",
    ):
        peer.delta_hstu_mha(12, None, q[:7], k, v, offs)


@pytest.mark.parametrize("peer", [gr, tzrec])
def test_delta_more_rows_than_a_sequence_holds_is_a_named_error(peer):
    offs, q, k, v = whole_sequences()
    # Named as these callers know it: they never pass q_start (it is derived from delta_q's rows).
    with pytest.raises(
        ValueError,
        match=r"delta_q.shape\[0\]: expected at most B \* \(the shortest sequence's "
        r"rows\) = 4 \* 3 \(the last delta_q.shape\[0\] / B rows of every sequence; "
        r"sequence 1 has 3\), got 16",
    ):
        peer.delta_hstu_mha(12, None, q[:16], k, v, offs)  # 4 rows each, but sequence 1 has 3


@pytest.mark.parametrize("peer", [gr, tzrec])
def test_delta_unknown_kernel_is_a_named_error(peer):
    offs, q, k, v = whole_sequences()
    with pytest.raises(ValueError, match=r"kernel: expected a kernel enum member or name, one of \['AUTO', "):
        peer.delta_hstu_mha(12, None, q[:4], k, v, offs, kernel="FAST")


def test_delta_kernel_choices_follow_the_peers(monkeypatch):
    # GR's delta dispatch has no CUDA branch (its PyTorch path runs); tzrec's maps CUTLASS to Triton.
    offs, q, k, v = whole_sequences()
    rows = last_rows(LENGTHS, 3)
    want = flexhstu.delta_hstu_mha(12, None, q[rows], k, v, offs, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(
        gr.delta_hstu_mha(12, None, q[rows], k, v, offs, kernel=gr.HammerKernel.CUDA), want, rtol=0, atol=0
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton on CPU tensors then refuses, naming the device
    with pytest.raises(ValueError, match=r"q.device: expected CUDA for Kernel\.TRITON"):
        tzrec.delta_hstu_mha(12, None, q[rows].float(), k.float(), v.float(), offs, kernel=tzrec.Kernel.CUTLASS)
    with pytest.raises(ValueError, match=r"q.device: expected CUDA for Kernel\.TRITON"):
        gr.delta_hstu_mha(12, None, q[rows].float(), k.float(), v.float(), offs, kernel=gr.HammerKernel.TRITON_CC)
