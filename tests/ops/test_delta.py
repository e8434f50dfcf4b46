"""delta_hstu_mha: every output row equals the matching row of a full hstu_mha call; forward only; checked inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks


def qkv(total, heads=2, dqk=8, dv=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(total, heads, dqk, generator=g, dtype=dtype) for _ in range(2))
    return q, k, torch.randn(total, heads, dv, generator=g, dtype=dtype)


def query_rows(lengths, starts, counts):
    """Jagged rows of the full layout that the queries are, and the query layout ``(q_offsets, q_start)``."""
    offs = offsets_from(lengths)
    rows = torch.cat(
        [torch.arange(int(offs[b]) + s, int(offs[b]) + s + n) for b, (s, n) in enumerate(zip(starts, counts))]
        + [torch.zeros(0, dtype=torch.int64)]
    )
    return rows, offsets_from(counts), torch.tensor(starts, dtype=torch.int64)


def full_funcs(lengths):
    offs = offsets_from(lengths)
    nt = torch.tensor([L // 3 // 2 * 2 for L in lengths])
    g = torch.Generator().manual_seed(3)
    return {
        "causal": masks.causal(offs),
        "sla": masks.sla(offs, 3, 2, num_targets=nt),
        "onerank": masks.onerank(offs, nt, 2),
        "random-per-head": torch.randint(-1, max(lengths) + 2, (2, 5, sum(lengths)), generator=g, dtype=torch.int32),
    }


LENGTHS, STARTS, COUNTS = [9, 0, 13, 5, 6], [4, 0, 0, 5, 2], [5, 0, 7, 0, 3]


@pytest.mark.parametrize("name", ["causal", "sla", "onerank", "random-per-head"])
def test_func_rows_equal_the_rows_of_a_full_call(name):
    offs = offsets_from(LENGTHS)
    func = full_funcs(LENGTHS)[name]
    q, k, v = qkv(sum(LENGTHS))
    rows, q_offsets, q_start = query_rows(LENGTHS, STARTS, COUNTS)
    full = flexhstu.hstu_mha(13, 0.4, q, k, v, offs, attn_func=func, kernel=Kernel.PYTORCH)
    got = flexhstu.delta_hstu_mha(
        13,
        0.4,
        q[rows],
        k,
        v,
        offs,
        q_offsets=q_offsets,
        q_start=q_start,
        attn_func=func[:, :, rows],
        kernel=Kernel.PYTORCH,
    )
    torch.testing.assert_close(got, full[rows], rtol=1e-12, atol=1e-12)


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    data=st.data(),
    window=st.integers(0, 4),
    contextual=st.integers(0, 3),
    with_targets=st.booleans(),
)
def test_fixed_rule_rows_equal_the_rows_of_a_full_call(lengths, data, window, contextual, with_targets):
    starts = [data.draw(st.integers(0, L)) for L in lengths]
    counts = [data.draw(st.integers(0, L - s)) for L, s in zip(lengths, starts)]
    nt = torch.tensor([data.draw(st.integers(0, L)) for L in lengths]) if with_targets else None
    offs = offsets_from(lengths)
    q, k, v = qkv(sum(lengths), seed=len(lengths))
    rows, q_offsets, q_start = query_rows(lengths, starts, counts)
    rule = dict(num_targets=nt, max_attn_len=window, contextual_seq_len=contextual, min_full_attn_seq_len=1)
    full = flexhstu.hstu_mha(20, None, q, k, v, offs, kernel=Kernel.PYTORCH, **rule)
    got = flexhstu.delta_hstu_mha(
        20, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start, kernel=Kernel.PYTORCH, **rule
    )
    torch.testing.assert_close(got, full[rows], rtol=1e-12, atol=1e-12)


def test_last_rows_convention_matches_the_generative_recommenders_call():
    lengths, delta = [6, 9, 4], 3
    offs = offsets_from(lengths)
    nt = torch.tensor([2, 3, 1])
    q, k, v = qkv(sum(lengths))
    rows = torch.cat([torch.arange(int(offs[b + 1]) - delta, int(offs[b + 1])) for b in range(3)])
    full = flexhstu.hstu_mha(
        9, 0.3, q, k, v, offs, num_targets=nt, max_attn_len=4, contextual_seq_len=1, kernel=Kernel.PYTORCH
    )
    # Positional head of generative-recommenders: (max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets,
    # max_attn_len, contextual_seq_len, kernel).
    got = flexhstu.delta_hstu_mha(9, 0.3, q[rows], k, v, offs, nt, 4, 1, Kernel.PYTORCH)
    torch.testing.assert_close(got, full[rows], rtol=1e-12, atol=1e-12)
    q_offsets, q_start = flexhstu.last_rows_offsets(offs, delta)
    assert q_offsets.tolist() == [0, 3, 6, 9] and q_start.tolist() == [3, 6, 1]


def test_scale_defaults_to_max_seq_len_and_scaling_seqlen_replaces_it():
    lengths = [5, 7]
    offs = offsets_from(lengths)
    q, k, v = qkv(12)
    q_offsets, q_start = flexhstu.last_rows_offsets(offs, 2)
    rows = torch.tensor([3, 4, 10, 11])
    base = flexhstu.delta_hstu_mha(10, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start)
    scaled = flexhstu.delta_hstu_mha(
        10, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start, scaling_seqlen=4
    )
    full = flexhstu.hstu_mha(10, None, q, k, v, offs, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(base, full[rows])
    torch.testing.assert_close(scaled, full[rows] * 10 / 4)


def test_nan_in_an_unseen_key_or_another_sequence_does_not_reach_the_output():
    offs = offsets_from([6, 5])
    q, k, v = qkv(11)
    layout = dict(q_offsets=torch.tensor([0, 2, 3]), q_start=torch.tensor([2, 1]))
    clean = flexhstu.delta_hstu_mha(6, None, q[[2, 3, 7]], k, v, offs, **layout)
    k[4], k[5], k[10] = float("nan"), float("nan"), float("nan")  # causal: rows 2, 3 and 1 never see these keys
    v[0] = float("nan")  # sequence 0 only
    dirty = flexhstu.delta_hstu_mha(6, None, q[[2, 3, 7]], k, v, offs, **layout)
    assert dirty[:2].isnan().all()  # rows of sequence 0 do see v[0]
    torch.testing.assert_close(dirty[2:], clean[2:], rtol=0, atol=0)
    k[6] = float("inf")  # a key every row of sequence 1 sees
    assert not torch.isfinite(flexhstu.delta_hstu_mha(6, None, q[[2, 3, 7]], k, v, offs, **layout)[2]).any()


def test_strided_and_half_inputs_give_the_rows_of_a_full_call():
    lengths = [7, 4]
    offs = offsets_from(lengths)
    big_q, big_k, big_v = qkv(11, heads=4, dtype=torch.float32)
    q, k, v = big_q[:, ::2], big_k[:, ::2], big_v[:, ::2]  # strided heads
    rows = torch.tensor([5, 6, 9, 10])
    q_offsets, q_start = flexhstu.last_rows_offsets(offs, 2)
    full = flexhstu.hstu_mha(7, None, q, k, v, offs, kernel=Kernel.PYTORCH)
    got = flexhstu.delta_hstu_mha(7, None, q[rows], k, v, offs, q_offsets=q_offsets[::1], q_start=q_start)
    torch.testing.assert_close(got, full[rows])
    half = flexhstu.delta_hstu_mha(
        7, None, q[rows].bfloat16(), k.bfloat16(), v.bfloat16(), offs, q_offsets=q_offsets, q_start=q_start
    )
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full[rows], rtol=2e-2, atol=2e-2)


def test_empty_queries_and_empty_keys_give_empty_or_zero_rows():
    offs = offsets_from([0, 0])
    q, k, v = qkv(0)
    layout = dict(q_offsets=torch.tensor([0, 0, 0]), q_start=torch.tensor([0, 0]))
    out = flexhstu.delta_hstu_mha(4, None, q, k, v, offs, **layout)
    assert out.shape == (0, 2, 6)
    # Audit: a batch of no sequence without q_offsets said "expected a multiple of the batch size 0, got 0".
    assert flexhstu.delta_hstu_mha(4, None, q, k, v, torch.tensor([0])).shape == (0, 2, 6)
    with pytest.raises(ValueError, match=r"delta_q.shape\[0\]: expected 0 \(seq_offsets holds no sequence\), got 3"):
        flexhstu.delta_hstu_mha(4, None, qkv(3)[0], k, v, torch.tensor([0]))


def test_asking_for_a_gradient_raises_forward_only():
    offs = offsets_from([4])
    q, k, v = qkv(4)
    k.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"delta_hstu_mha is forward-only \(inference\).*requires_grad: k"):
        flexhstu.delta_hstu_mha(4, None, q[2:], k, v, offs)
    with torch.no_grad():
        out = flexhstu.delta_hstu_mha(4, None, q[2:], k, v, offs)
    assert out.shape == (2, 2, 6)


I32 = dict(dtype=torch.int32)
BAD = [
    (
        dict(q_start=torch.tensor([3, 0])),
        ValueError,
        r"q_start\[0\]: expected 0 <= q_start <= L - \(query rows\) = 5 - 3",
    ),
    (dict(q_start=torch.tensor([-1, 0])), ValueError, r"q_start\[0\]: expected 0 <= q_start"),
    (dict(q_start=torch.tensor([0.0, 0.0])), TypeError, r"q_start: expected an integer tensor"),
    (dict(q_start=torch.tensor([0])), ValueError, r"q_start: expected a \(2,\) tensor"),
    (dict(q_offsets=torch.tensor([0, 4])), ValueError, r"q_offsets: expected B \+ 1 = 3 offsets"),
    (dict(q_offsets=torch.tensor([0, 3, 3])), ValueError, r"q_offsets\[-1\]: expected the number of rows of the data"),
    (dict(q_start=None), ValueError, r"q_start: expected a tensor next to q_offsets"),
    (dict(attn_func=torch.zeros(1, 1, 6, **I32)), ValueError, r"attn_func.shape\[2\]: expected one column per"),
    (dict(attn_func=torch.zeros(1, 1, 4, **I32), max_attn_len=2), ValueError, r"leave max_attn_len at the default"),
    (dict(max_seq_len=4), ValueError, r"max_seq_len: expected at least every sequence length"),
    (dict(kernel=Kernel.CUTLASS), ValueError, r"kernel: expected Kernel.AUTO, PYTORCH or TRITON"),
    (dict(num_targets=torch.tensor([6, 0])), ValueError, r"num_targets\[0\]: expected 0 <= T <= the sequence length 5"),
]


@pytest.mark.parametrize("change, error, message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_bad_query_layout_raises_naming_the_argument(change, error, message):
    offs = offsets_from([5, 3])
    q, k, v = qkv(8)
    args = dict(max_seq_len=8, q_offsets=torch.tensor([0, 3, 4]), q_start=torch.tensor([2, 2]))
    args.update(change)
    dq = q[:4]
    with pytest.raises(error, match=message):
        flexhstu.delta_hstu_mha(args.pop("max_seq_len"), None, dq, k, v, offs, **args)


def test_mismatched_tensors_raise_naming_the_argument():
    offs = offsets_from([5, 3])
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match=r"v.shape\[0\]: expected the rows of k \(8\), got 7"):
        flexhstu.delta_hstu_mha(8, None, q[:2], k, v[:7], offs)
    with pytest.raises(TypeError, match=r"k.dtype: expected the dtype of delta_q"):
        flexhstu.delta_hstu_mha(8, None, q[:2], k.float(), v, offs)
    with pytest.raises(ValueError, match=r"delta_q.shape\[0\]: expected a multiple of the batch size 2"):
        flexhstu.delta_hstu_mha(8, None, q[:3], k, v, offs)
    with pytest.raises(ValueError, match=r"seq_offsets\[-1\]: expected the number of rows of the data \(8\)"):
        flexhstu.delta_hstu_mha(8, None, q[:2], k, v, offsets_from([5, 2]))
