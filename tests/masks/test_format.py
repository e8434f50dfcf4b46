"""The func format: widening, decoding, dense round trips, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rules import offsets_from

import flexhstu
from flexhstu import masks


def random_func(lengths, nfunc, hf=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    hi = max(max(lengths), 1) + 2
    return torch.randint(-2, hi, (hf, nfunc, total), generator=g, dtype=torch.int32)


def test_interchange_width_is_five():
    assert flexhstu.HSTU_ARBITRARY_NFUNC == 5
    assert masks.num_intervals(5) == 3 and masks.num_intervals(1) == 1 and masks.num_intervals(7) == 4
    with pytest.raises(ValueError, match="nfunc"):
        masks.num_intervals(4)


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
    extra=st.sampled_from([2, 4]),
)
def test_widened_masks_decode_identically_and_padding_is_empty(lengths, seed, extra):
    offs = offsets_from(lengths)
    n = max(max(lengths), 1)
    func = random_func(lengths, 3, seed=seed)
    wide = masks.widen(func, 3 + extra)
    assert wide.shape[1] == 3 + extra
    assert torch.equal(masks.to_dense(wide, offs, n), masks.to_dense(func, offs, n))
    for j in range(2, (3 + extra + 1) // 2):
        start, end = wide[:, 2 * j - 1], wide[:, 2 * j]
        assert bool((end <= start).all()), f"padded interval {j} is not empty"


def test_widen_keeps_a_stride0_expansion():
    offs = offsets_from([4, 3])
    wide = masks.widen(masks.causal(offs, nheads=8), 5)
    assert wide.shape == (8, 5, 7) and wide.stride(0) == 0


def test_decode_reads_every_interval_of_a_five_wide_func():
    """Every interval of this 5-wide func carries a live boundary.

    Row i (L = 12) sees [0, a) u [a + 1, b) u [b + 1, i + 1) with a = min(2, i),
    b = min(6, i): three non-empty pieces whose gaps are single columns. A decoder
    that drops the last interval (``range(1, nint - 1)``), reads rows 3-4 as
    rows 1-2, or swaps start and end, turns the expected picture into another;
    checked by mutating ``to_dense`` that way (the test failed each time).
    """
    L = 12
    offs = offsets_from([L])
    i = torch.arange(L)
    a = i.clamp(max=2)
    b = i.clamp(max=6)
    func = torch.stack([a, a + 1, b, b + 1, i + 1]).to(torch.int32)[None]
    vis = masks.to_dense(func, offs, L)[0, 0]
    for row in range(L):
        ar, br = min(2, row), min(6, row)
        want = [(c < ar) or (ar + 1 <= c < br) or (br + 1 <= c < row + 1) for c in range(L)]
        assert vis[row].tolist() == want, row
    # The third interval alone is what makes the diagonal visible from row 7 on.
    assert all(vis[r, r] for r in range(7, L))


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
    hf=st.sampled_from([1, 3]),
    nfunc=st.sampled_from([1, 3, 5, 7]),
)
def test_from_dense_round_trips(lengths, seed, hf, nfunc):
    offs = offsets_from(lengths)
    n = max(max(lengths), 1)
    dense = masks.to_dense(random_func(lengths, nfunc, hf, seed), offs, n)
    back = masks.from_dense(dense, offs)
    assert back.shape[0] == hf and back.shape[1] <= max(nfunc, 1)
    assert torch.equal(masks.to_dense(back, offs, n), dense)


def test_from_dense_compresses_an_arbitrary_mask_to_its_minimal_width():
    offs = offsets_from([6])
    dense = torch.zeros(1, 6, 6, dtype=torch.bool)
    dense[0, 5, [1, 3, 5]] = True  # three runs, none at column 0: 4 slots -> NFUNC 7
    dense[0, 0, 0] = True
    func = masks.from_dense(dense, offs)
    assert func.shape == (1, 7, 6)
    assert torch.equal(masks.to_dense(func, offs, 6)[:, 0], dense)


def test_from_dense_names_the_row_that_needs_more_intervals():
    offs = offsets_from([3, 6])
    dense = torch.zeros(2, 6, 6, dtype=torch.bool)
    dense[1, 4, [0, 2, 4]] = True
    with pytest.raises(ValueError, match=r"sequence 1, head 0, row 4 needs 5 func rows \(3 intervals\); nfunc=3"):
        masks.from_dense(dense, offs, nfunc=3)


def test_validate_accepts_builder_output_and_names_bad_arguments():
    offs = offsets_from([4, 0, 3])
    func = masks.causal(offs)
    assert masks.validate(func, offs, nheads=2) is func
    with pytest.raises(TypeError, match=r"func: expected dtype torch.int32, got torch.int64"):
        masks.validate(func.long(), offs)
    with pytest.raises(ValueError, match=r"func: expected a 3-D tensor"):
        masks.validate(func[0], offs)
    with pytest.raises(ValueError, match=r"NFUNC\): expected an odd width >= 1, got 2"):
        masks.validate(torch.zeros(1, 2, 7, dtype=torch.int32), offs)
    with pytest.raises(ValueError, match=r"func.shape\[2\]: expected one column per query row \(7\)|seq_offsets\[-1\]"):
        masks.validate(func[:, :, :5], offs)
    with pytest.raises(ValueError, match=r"Hf\): expected 1 or the number of heads \(2\), got 3"):
        masks.validate(func.expand(3, 1, 7), offs, nheads=2)
    with pytest.raises(ValueError, match=r"seq_offsets\[0\]: expected 0, got 1"):
        masks.validate(func, torch.tensor([1, 4, 7]))
    with pytest.raises(ValueError, match=r"seq_offsets: expected non-decreasing offsets"):
        masks.validate(func, torch.tensor([0, 5, 4, 7]))


def test_builders_reject_bad_parameters():
    offs = offsets_from([5, 4])
    with pytest.raises(ValueError, match=r"sla_k1: expected an int >= 1, got -1"):
        masks.sla(offs, -1, 2)
    with pytest.raises(ValueError, match=r"sla_k2: expected a non-negative int, got -3"):
        masks.sla(offs, 1, -3)
    with pytest.raises(ValueError, match=r"num_targets\[1\]: expected 0 <= T <= the sequence length 4, got 5"):
        masks.fixed(offs, num_targets=torch.tensor([1, 5]))
    with pytest.raises(ValueError, match=r"num_targets\[0\]: expected a multiple of group_size=3, got 4"):
        masks.onerank(offs, torch.tensor([4, 3]), 3)
    with pytest.raises(ValueError, match=r"nfunc: expected at least this rule's width 5, got 3"):
        masks.onerank(offs, torch.tensor([3, 3]), 3, nfunc=3)
    with pytest.raises(ValueError, match=r"nfunc: expected an odd int >= 1, got 4"):
        masks.causal(offs, nfunc=4)


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
    hf=st.sampled_from([1, 2]),
    nfunc=st.sampled_from([1, 3, 5, 7]),
)
def test_count_visible_equals_the_dense_count(lengths, seed, hf, nfunc):
    offs = offsets_from(lengths)
    func = random_func(lengths, nfunc, hf, seed)
    dense = masks.to_dense(func, offs, max(max(lengths), 1))
    assert masks.count_visible(func, offs).tolist() == dense.sum(dim=(0, 2, 3)).tolist()


@pytest.mark.parametrize(
    "offs,msg",
    [
        ([1, 4, 8], r"seq_offsets\[0\]: expected 0, got 1"),
        ([0, 5, 3], r"seq_offsets: expected non-decreasing offsets"),
    ],
)
def test_from_dense_refuses_bad_offsets(offs, msg):
    # Unchecked, [1, 4, 8] gives a func shifted by one row and [0, 5, 3] an IndexError.
    dense = torch.ones(2, 6, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=msg):
        masks.from_dense(dense, torch.tensor(offs))


def test_from_dense_of_empty_sequences_is_an_empty_func():
    func = masks.from_dense(torch.ones(1, 0, 0, dtype=torch.bool), torch.tensor([0, 0]))
    assert func.shape == (1, 1, 0)


def test_count_visible_refuses_offsets_of_another_total():
    func = masks.causal(torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"seq_offsets\[-1\]: expected the number of rows of the data \(7\), got 9"):
        masks.count_visible(func, torch.tensor([0, 3, 9]))


def test_the_picture_names_a_head_the_func_does_not_have(tmp_path):
    # Head 5 of a two-head func is an error, not head 1 drawn without a word.
    import torch

    from flexhstu import masks
    from flexhstu.masks import picture

    offs = torch.tensor([0, 4, 7])
    two = torch.cat([masks.causal(offs), masks.sla(offs, 2, 1)[:, :1]])  # (2, 1, 7): head 1 sees less
    assert picture.render(two, offs, 4, str(tmp_path / "h1.png"), head=1) == str(tmp_path / "h1.png")
    with pytest.raises(ValueError, match=r"head: expected a head of the func, 0 to 1, got 5"):
        picture.render(two, offs, 4, str(tmp_path / "h5.png"), head=5)
    with pytest.raises(ValueError, match=r"head: expected a non-negative int, got -1"):
        picture.render(two, offs, 4, str(tmp_path / "hm.png"), head=-1)
    picture.render(two[:1], offs, 4, str(tmp_path / "any.png"), head=3)  # one func for every head


def test_numpy_ints_and_bools_are_accepted_where_python_ones_are():
    # As max_seq_len and causal take NumPy values, masks.causal(nfunc=np.int64(3)) and build_plan(sparse=np.True_)
    # must too (not "expected an odd int >= 1, got int64"; "expected None or a bool, got bool").
    import numpy as np

    offs = offsets_from([5, 3])
    f = masks.causal(offs)
    assert torch.equal(masks.causal(offs, nfunc=np.int64(3)), masks.causal(offs, nfunc=3))
    assert torch.equal(masks.widen(f, np.int32(5)), masks.widen(f, 5))
    dense = masks.to_dense(f, offs, 5)
    assert torch.equal(masks.from_dense(dense, offs, nfunc=np.int64(3)), masks.from_dense(dense, offs, nfunc=3))
    assert masks.num_intervals(np.int64(5)) == 3
    assert flexhstu.build_plan(offs, total=8, max_seq_len=5, sparse=np.True_).sparse is True
    for bad, exc in ((True, TypeError), (3.0, TypeError), (np.int64(4), ValueError)):
        with pytest.raises(exc, match=r"nfunc: expected an odd int >= 1"):
            masks.widen(f, bad)
    with pytest.raises(TypeError, match=r"sparse: expected None or a bool \(Python or NumPy\), got str"):
        flexhstu.build_plan(offs, total=8, max_seq_len=5, sparse="yes")


def test_the_picture_draws_empty_batches_and_names_cell_and_path(tmp_path):
    # Unchecked, max_seq_len 0 raises an IndexError from a shape mismatch, a negative or fractional cell PIL's or
    # range's errors, a path without an image extension PIL's "unknown file extension".
    import torch

    from flexhstu.masks import picture

    empty, offs = torch.zeros(1, 1, 0, dtype=torch.int32), torch.tensor([0, 0])
    out = str(tmp_path / "empty.png")
    assert picture.render(empty, offs, 0, out) == out and (tmp_path / "empty.png").stat().st_size > 0
    with pytest.raises(ValueError, match=r"^cell: expected a non-negative int, got -2$"):
        picture.render(empty, offs, 0, out, cell=-2)
    with pytest.raises(TypeError, match=r"^cell: expected a non-negative int, got float$"):
        picture.render(empty, offs, 0, out, cell=2.5)
    with pytest.raises(
        ValueError,
        match=r"^path: expected a file name ending in an image extension such as \.png, "
        r"got '.*mask'$",
    ):
        picture.render(empty, offs, 0, str(tmp_path / "mask"))
