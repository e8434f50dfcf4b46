"""Every builder against an independent per-pair reading of its rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rules import dense_from_rule, fixed_visible, offsets_from, onerank_visible, sla_visible

from flexhstu import masks

lengths_st = st.lists(st.integers(0, 13), min_size=1, max_size=4)
offset_dtype_st = st.sampled_from([torch.int32, torch.int64])


@given(lengths=lengths_st, dtype=offset_dtype_st)
def test_causal_row_sees_its_past_and_itself(lengths, dtype):
    offs = offsets_from(lengths, dtype)
    n = max(lengths)
    func = masks.causal(offs)
    assert func.shape == (1, 1, sum(lengths)) and func.dtype == torch.int32
    want = dense_from_rule(lengths, n, lambda b, i, j, L: j <= i)
    assert torch.equal(masks.to_dense(func, offs, n), want)


@given(
    data=st.data(),
    lengths=lengths_st,
    dtype=offset_dtype_st,
    use_targets=st.booleans(),
    c=st.integers(0, 4),
    w=st.integers(0, 5),
    f=st.integers(0, 4),
)
def test_fixed_matches_the_reference_rule(data, lengths, dtype, use_targets, c, w, f):
    offs = offsets_from(lengths, dtype)
    n = max(lengths)
    targets = [data.draw(st.integers(0, L)) for L in lengths] if use_targets else None
    nt = torch.tensor(targets) if use_targets else None
    func = masks.fixed(offs, num_targets=nt, max_attn_len=w, contextual_seq_len=c, min_full_attn_seq_len=f)
    want = dense_from_rule(
        lengths, n, lambda b, i, j, L: fixed_visible(i, j, L, targets[b] if use_targets else 0, c, w, f, use_targets)
    )
    assert torch.equal(masks.to_dense(func, offs, n), want)
    dense = masks.dense_fixed(offs, n, num_targets=nt, max_attn_len=w, contextual_seq_len=c, min_full_attn_seq_len=f)
    assert torch.equal(dense, want)


def test_fixed_width_is_minimal_per_rule():
    offs = offsets_from([9, 4])
    nt = torch.tensor([3, 1])
    assert masks.fixed(offs).shape[1] == 1
    assert masks.fixed(offs, num_targets=nt).shape[1] == 3
    assert masks.fixed(offs, max_attn_len=2).shape[1] == 3
    assert masks.fixed(offs, contextual_seq_len=2).shape[1] == 3
    assert masks.fixed(offs, num_targets=nt, max_attn_len=2).shape[1] == 5


def test_target_row_under_slid_window_needs_three_intervals():
    # L=8, T=2, W=2: target rows see [lo, Hb) u {i} with lo > 0.
    offs = offsets_from([8])
    func = masks.fixed(offs, num_targets=torch.tensor([2]), max_attn_len=2)
    row7 = masks.to_dense(func, offs, 8)[0, 0, 7]
    assert row7.tolist() == [False, False, False, False, True, True, False, True]


@given(
    data=st.data(),
    lengths=lengths_st,
    dtype=offset_dtype_st,
    k1=st.integers(1, 6),
    k2=st.integers(0, 5),
    c=st.integers(0, 4),
    use_targets=st.booleans(),
)
def test_sla_matches_the_seed_rule(data, lengths, dtype, k1, k2, c, use_targets):
    offs = offsets_from(lengths, dtype)
    n = max(lengths)
    targets = [data.draw(st.integers(0, L)) for L in lengths] if use_targets else [0] * len(lengths)
    nt = torch.tensor(targets) if use_targets else None
    func = masks.sla(offs, k1, k2, num_targets=nt, contextual_seq_len=c)
    assert func.shape[1] == 3
    want = dense_from_rule(lengths, n, lambda b, i, j, L: sla_visible(i, j, L, targets[b], k1, k2, c))
    assert torch.equal(masks.to_dense(func, offs, n), want)


def test_sla_refuses_a_local_window_of_zero_as_the_cli_does():
    # Guards against: --sla-k1 0 was refused by the command line but masks.sla built a mask in which history rows past
    # the prefix could not see themselves.
    with pytest.raises(ValueError, match=r"^sla_k1: expected an int >= 1, got 0$"):
        masks.sla(offsets_from([5, 4]), 0, 2)


@given(lengths=lengths_st)
def test_sla_with_full_window_and_no_prefix_is_causal(lengths):
    offs = offsets_from(lengths)
    n = max(lengths)
    k1 = max(n, 1)  # a window as long as every sequence (K1 >= 1)
    assert torch.equal(masks.to_dense(masks.sla(offs, k1, 0), offs, n), masks.to_dense(masks.causal(offs), offs, n))


@given(
    data=st.data(),
    hist=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    group=st.integers(1, 4),
    dtype=offset_dtype_st,
)
def test_onerank_matches_the_rule(data, hist, group, dtype):
    ncand = [data.draw(st.integers(0, 3)) for _ in hist]
    targets = [m * group for m in ncand]
    lengths = [h + t for h, t in zip(hist, targets)]
    offs = offsets_from(lengths, dtype)
    n = max(max(lengths), 1)
    func = masks.onerank(offs, torch.tensor(targets), group)
    assert func.shape[1] == (5 if group > 1 else 3)
    want = dense_from_rule(lengths, n, lambda b, i, j, L: onerank_visible(i, j, L, targets[b], group))
    assert torch.equal(masks.to_dense(func, offs, n), want)


def test_onerank_groups_and_task_tokens_are_private():
    hist, group, ncand = 5, 4, 3
    L = hist + group * ncand
    offs = offsets_from([L])
    vis = masks.to_dense(masks.onerank(offs, torch.tensor([group * ncand]), group), offs, L)[0, 0]
    for a in range(ncand):
        ga = hist + a * group
        for k in range(group):
            row = ga + k
            seen = set(torch.nonzero(vis[row]).flatten().tolist())
            expected = set(range(hist)) | {ga, row}
            assert seen == expected, (row, seen)
            for b in range(ncand):
                if b != a:  # groups never see each other
                    assert not vis[row, hist + b * group : hist + (b + 1) * group].any()


def test_builders_return_a_stride0_view_for_heads():
    offs = offsets_from([5, 3])
    for func in (
        masks.causal(offs, nheads=4),
        masks.sla(offs, 2, 1, nheads=4),
        masks.onerank(offs, torch.tensor([2, 2]), 2, nheads=4),
        masks.fixed(offs, max_attn_len=2, nheads=4),
    ):
        assert func.shape[0] == 4 and func.stride(0) == 0


def test_total_avoids_reading_offsets_and_gives_the_same_func():
    offs = offsets_from([5, 0, 7])
    assert torch.equal(masks.sla(offs, 3, 1, total=12), masks.sla(offs, 3, 1))


def test_zero_length_batch_builds_empty_funcs():
    offs = offsets_from([0, 0])
    assert masks.causal(offs).shape == (1, 1, 0)
    assert masks.onerank(offs, torch.tensor([0, 0]), 3).shape == (1, 5, 0)


BUILDERS = {
    "causal": lambda offs, **kw: masks.causal(offs, **kw),
    "fixed": lambda offs, **kw: masks.fixed(offs, max_attn_len=2, **kw),
    "sla": lambda offs, **kw: masks.sla(offs, 3, 1, **kw),
    "onerank": lambda offs, **kw: masks.onerank(offs, torch.zeros(offs.numel() - 1, dtype=torch.int64), 2, **kw),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize(
    "offs,total,msg",
    [
        ([3, 12, 21], None, r"seq_offsets\[0\]: expected 0, got 3"),
        ([0, 12, 5], None, r"seq_offsets: expected non-decreasing offsets, got seq_offsets\[2\] = 5 < "),
        ([3, 12, 21], 21, r"seq_offsets\[0\]: expected 0, got 3"),
        ([0, 5, 9], 8, r"seq_offsets\[-1\]: expected the number of rows of the data \(8\), got 9"),
    ],
)
def test_builders_check_the_offsets_with_and_without_total(name, offs, total, msg):
    with pytest.raises(ValueError, match=msg):
        BUILDERS[name](torch.tensor(offs), total=total)


@pytest.mark.parametrize("name", ["fixed", "sla"])
def test_builders_given_total_still_check_cpu_targets(name):
    offs = offsets_from([5, 4])
    build = {"fixed": masks.fixed, "sla": lambda o, **kw: masks.sla(o, 2, 1, **kw)}[name]
    with pytest.raises(ValueError, match=r"num_targets\[1\]: expected 0 <= T <= the sequence length 4, got 5"):
        build(offs, num_targets=torch.tensor([1, 5]), total=9)


def test_builders_reject_float_targets():
    with pytest.raises(TypeError, match=r"num_targets: expected an integer tensor .*, got torch.float32"):
        masks.fixed(offsets_from([5, 4]), num_targets=torch.tensor([1.0, 2.0]))


def test_builder_parameters_accept_numpy_integers():
    offs = offsets_from([6, 3])
    want = masks.sla(offs, 3, 1, nheads=2)
    assert torch.equal(masks.sla(offs, np.int64(3), np.int32(1), total=np.int64(9), nheads=np.int64(2)), want)


def test_to_dense_rejects_a_max_seq_len_below_a_sequence_length():
    offs = offsets_from([3, 7])
    msg = r"max_seq_len: expected at least every sequence length \(sequence 1 has 7\), got 5"
    with pytest.raises(ValueError, match=msg):
        masks.to_dense(masks.causal(offs), offs, 5)


@pytest.mark.parametrize("name", ["fixed", "sla", "onerank"])
def test_value_checks_cannot_be_switched_off(name):
    offs = torch.tensor([0, 5, 9])
    with pytest.raises(TypeError, match="_check"):
        BUILDERS[name](offs, total=8, _check=False)
