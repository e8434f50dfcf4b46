"""The Triton delta kernel (interpreter on CPU): every row equals the matching row of a full reference call."""

from __future__ import annotations

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.triton.delta_op import triton_delta_hstu_mha

# Long enough to cross several 32-row query blocks and 16-column key blocks; one empty sequence.
LENGTHS, STARTS, COUNTS = [40, 0, 70, 9], [10, 0, 3, 0], [30, 0, 50, 9]
TARGETS = torch.tensor([6, 0, 12, 3])


def batch(dtype=torch.float32, dqk=16, dv=24):
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k = (torch.randn(total, 2, dqk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(total, 2, dv, generator=g).to(dtype)
    offs = offsets_from(LENGTHS)
    rows = torch.cat([torch.arange(int(offs[b]) + s, int(offs[b]) + s + n)
                      for b, (s, n) in enumerate(zip(STARTS, COUNTS))])
    return q, k, v, offs, rows, offsets_from(COUNTS), torch.tensor(STARTS)


def funcs(offs):
    g = torch.Generator().manual_seed(4)
    return {
        "onerank": masks.onerank(offs, TARGETS, 3),
        "sla": masks.sla(offs, 7, 3, num_targets=TARGETS),
        "random-per-head": torch.randint(-2, 75, (2, 7, int(offs[-1])), generator=g, dtype=torch.int32),
    }


RULES = {"causal": {}, "fixed": dict(num_targets=TARGETS, max_attn_len=5, contextual_seq_len=2,
                                     min_full_attn_seq_len=3)}


@pytest.mark.parametrize("name", ["causal", "fixed", "onerank", "sla", "random-per-head"])
def test_triton_delta_rows_equal_the_rows_of_a_full_reference_call(name):
    q, k, v, offs, rows, q_offsets, q_start = batch()
    if name in RULES:
        full_kw = delta_kw = RULES[name]
    else:
        func = funcs(offs)[name]
        full_kw, delta_kw = dict(attn_func=func), dict(attn_func=func[:, :, rows])
    full = flexhstu.hstu_mha(80, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **full_kw)
    got = flexhstu.delta_hstu_mha(80, 0.3, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start,
                                  kernel=Kernel.TRITON, **delta_kw)
    torch.testing.assert_close(got, full[rows], rtol=2e-5, atol=2e-5)


def test_triton_delta_in_float16_with_a_padded_head_dim_is_within_half_tolerance():
    # Not bfloat16: Triton's interpreter computes tl.dot on bf16 tiles wrongly (the training kernel's too).
    q, k, v, offs, rows, q_offsets, q_start = batch(torch.float16, dqk=16, dv=20)
    full = flexhstu.hstu_mha(80, None, q.float(), k.float(), v.float(), offs, kernel=Kernel.PYTORCH)
    got = flexhstu.delta_hstu_mha(80, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start,
                                  kernel=Kernel.TRITON)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), full[rows], rtol=2e-2, atol=2e-2)


def test_query_rows_outside_their_sequence_get_zero_rows_without_a_check():
    # What an unchecked (CUDA) call with a bad q_start gets: rows past the end or before the start see nothing.
    q, k, v, offs, rows, q_offsets, _ = batch()
    bad_start = torch.tensor([25, 0, -20, 1000])  # rows 15.. of seq 0, rows 0..19 of seq 2, all of seq 3 are outside
    got = triton_delta_hstu_mha(q[rows], k, v, offs, q_offsets, bad_start, alpha=0.3, out_scale=1 / 80)
    want = flexhstu.ops.pytorch.delta.pytorch_delta_hstu_mha(
        q[rows], k, v, offs, q_offsets, bad_start, flexhstu.masks.rules.FixedRule(), alpha=0.3, scaling_seqlen=80,
        max_seq_len=80)
    outside = torch.cat([torch.arange(15, 30), torch.arange(30, 50), torch.arange(80, 89)])
    assert got[outside].abs().max() == 0
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_explicit_triton_without_a_supported_input_raises_with_the_reason():
    q, k, v, offs, rows, q_offsets, q_start = batch(torch.float64)
    with pytest.raises(ValueError, match=r"q.dtype: expected float16, bfloat16 or float32 for Kernel.TRITON"):
        flexhstu.delta_hstu_mha(80, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start,
                                kernel=Kernel.TRITON)
