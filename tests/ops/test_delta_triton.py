"""The Triton delta kernel (interpreter on CPU): every row equals the matching row of a full reference call."""

from __future__ import annotations

import pytest
import torch
from launches import counted_launches
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.triton.delta_op import forced_key_splits, key_splits, triton_delta_hstu_mha

# Long enough to cross several 32-row query blocks and 16-column key blocks; one empty sequence.
LENGTHS, STARTS, COUNTS = [40, 0, 70, 9], [10, 0, 3, 0], [30, 0, 50, 9]
TARGETS = torch.tensor([6, 0, 12, 3])


def batch(dtype=torch.float32, dqk=16, dv=24):
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k = (torch.randn(total, 2, dqk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(total, 2, dv, generator=g).to(dtype)
    offs = offsets_from(LENGTHS)
    rows = torch.cat(
        [torch.arange(int(offs[b]) + s, int(offs[b]) + s + n) for b, (s, n) in enumerate(zip(STARTS, COUNTS))]
    )
    return q, k, v, offs, rows, offsets_from(COUNTS), torch.tensor(STARTS)


def funcs(offs):
    g = torch.Generator().manual_seed(4)
    return {
        "onerank": masks.onerank(offs, TARGETS, 3),
        "sla": masks.sla(offs, 7, 3, num_targets=TARGETS),
        "random-per-head": torch.randint(-2, 75, (2, 7, int(offs[-1])), generator=g, dtype=torch.int32),
    }


RULES = {
    "causal": {},
    "fixed": dict(num_targets=TARGETS, max_attn_len=5, contextual_seq_len=2, min_full_attn_seq_len=3),
}


def mask_keywords(name, offs, rows):
    """(keywords of the full call, keywords of the delta call): the func's query-row columns for the delta."""
    if name in RULES:
        return RULES[name], RULES[name]
    func = funcs(offs)[name]
    return dict(attn_func=func), dict(attn_func=func[:, :, rows])


@pytest.mark.parametrize("name", ["causal", "fixed", "onerank", "sla", "random-per-head"])
def test_triton_delta_rows_equal_the_rows_of_a_full_reference_call(name):
    q, k, v, offs, rows, q_offsets, q_start = batch()
    full_kw, delta_kw = mask_keywords(name, offs, rows)
    full = flexhstu.hstu_mha(80, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **full_kw)
    got = flexhstu.delta_hstu_mha(
        80, 0.3, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start, kernel=Kernel.TRITON, **delta_kw
    )
    torch.testing.assert_close(got, full[rows], rtol=2e-5, atol=2e-5)


def test_triton_delta_in_float16_with_a_padded_head_dim_is_within_half_tolerance():
    # Not bfloat16: Triton's interpreter computes tl.dot on bf16 tiles wrongly (the training kernel's too).
    q, k, v, offs, rows, q_offsets, q_start = batch(torch.float16, dqk=16, dv=20)
    full = flexhstu.hstu_mha(80, None, q.float(), k.float(), v.float(), offs, kernel=Kernel.PYTORCH)
    got = flexhstu.delta_hstu_mha(
        80, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start, kernel=Kernel.TRITON
    )
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), full[rows], rtol=2e-2, atol=2e-2)


def test_query_rows_outside_their_sequence_get_zero_rows_without_a_check():
    # What an unchecked (CUDA) call with a bad q_start gets: rows past the end or before the start see nothing.
    q, k, v, offs, rows, q_offsets, _ = batch()
    bad_start = torch.tensor([25, 0, -20, 1000])  # rows 15.. of seq 0, rows 0..19 of seq 2, all of seq 3 are outside
    got = triton_delta_hstu_mha(q[rows], k, v, offs, q_offsets, bad_start, alpha=0.3, out_scale=1 / 80)
    want = flexhstu.ops.pytorch.delta_reference.pytorch_delta_hstu_mha(
        q[rows],
        k,
        v,
        offs,
        q_offsets,
        bad_start,
        flexhstu.masks.rules.FixedRule(),
        alpha=0.3,
        scaling_seqlen=80,
        max_seq_len=80,
    )
    outside = torch.cat([torch.arange(15, 30), torch.arange(30, 50), torch.arange(80, 89)])
    assert got[outside].abs().max() == 0
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_explicit_triton_without_a_supported_input_raises_with_the_reason():
    q, k, v, offs, rows, q_offsets, q_start = batch(torch.float64)
    with pytest.raises(ValueError, match=r"q.dtype: expected float16, bfloat16 or float32 for Kernel.TRITON"):
        flexhstu.delta_hstu_mha(
            80, None, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start, kernel=Kernel.TRITON
        )


@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("name", ["causal", "fixed", "onerank", "random-per-head"])
def test_key_blocks_split_across_programs_add_up_to_the_full_call(name, splits):
    # A split walks every splits-th key block of its query block; the float32 partial sums are added on the host.
    # 16 splits is more than any sequence's key blocks: most splits see nothing and must write zeros.
    q, k, v, offs, rows, q_offsets, q_start = batch()
    full_kw, delta_kw = mask_keywords(name, offs, rows)
    full = flexhstu.hstu_mha(80, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **full_kw)
    with forced_key_splits(splits):
        got = flexhstu.delta_hstu_mha(
            80, 0.3, q[rows], k, v, offs, q_offsets=q_offsets, q_start=q_start, kernel=Kernel.TRITON, **delta_kw
        )
    torch.testing.assert_close(got, full[rows], rtol=2e-5, atol=2e-5)


def test_small_requests_split_and_large_ones_do_not():
    assert key_splits(programs=8, kv_blocks=256, multiprocessors=132) == 16
    assert key_splits(programs=32, kv_blocks=256, multiprocessors=132) == 8
    assert key_splits(programs=8, kv_blocks=12, multiprocessors=132) == 2  # 6 key blocks each
    assert key_splits(programs=8, kv_blocks=7, multiprocessors=132) == 1  # too few key blocks to share
    assert key_splits(programs=512, kv_blocks=256, multiprocessors=132) == 1


def slotted(k, v, offs, room, garbage=float("nan")):
    """K and V in slots of ``L_b + room[b]`` rows, the spare rows filled with ``garbage``; the slots' offsets."""
    lengths = offs.diff()
    slot_offs = offsets_from((lengths + torch.tensor(room)).tolist())
    ks = torch.full((int(slot_offs[-1]), *k.shape[1:]), garbage)
    vs = torch.full((int(slot_offs[-1]), *v.shape[1:]), garbage)
    for b in range(len(lengths)):
        ks[slot_offs[b] : slot_offs[b] + lengths[b]] = k[offs[b] : offs[b + 1]]
        vs[slot_offs[b] : slot_offs[b] + lengths[b]] = v[offs[b] : offs[b + 1]]
    return ks, vs, slot_offs, lengths


@pytest.mark.parametrize("kernel", [Kernel.TRITON, Kernel.PYTORCH])
@pytest.mark.parametrize("name", ["causal", "fixed", "onerank"])
def test_kv_lengths_read_only_the_used_rows_of_each_slot(name, kernel):
    # Spare rows hold NaN: a kernel that read one would return NaN.
    q, k, v, offs, rows, q_offsets, q_start = batch()
    ks, vs, slot_offs, lengths = slotted(k, v, offs, room=[5, 3, 0, 17])
    full_kw, delta_kw = mask_keywords(name, offs, rows)
    full = flexhstu.hstu_mha(80, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **full_kw)
    with forced_key_splits(2):
        got = flexhstu.delta_hstu_mha(
            80,
            0.3,
            q[rows],
            ks,
            vs,
            slot_offs,
            q_offsets=q_offsets,
            q_start=q_start,
            kernel=kernel,
            kv_lengths=lengths,
            **delta_kw,
        )
    torch.testing.assert_close(got, full[rows], rtol=2e-5, atol=2e-5)


def test_kv_lengths_past_the_slot_are_refused_on_the_host_and_clamped_in_the_kernel():
    q, k, v, offs, rows, q_offsets, q_start = batch()
    ks, vs, slot_offs, lengths = slotted(k, v, offs, room=[0, 0, 0, 0], garbage=0.0)
    with pytest.raises(ValueError, match=r"kv_lengths\[2\].*0 <= kv_lengths <= the slot's rows 70"):
        flexhstu.delta_hstu_mha(
            80,
            0.3,
            q[rows],
            ks,
            vs,
            slot_offs,
            q_offsets=q_offsets,
            q_start=q_start,
            kv_lengths=lengths + torch.tensor([0, 0, 1, 0]),
        )
    with pytest.raises(TypeError, match="kv_lengths"):
        flexhstu.delta_hstu_mha(
            80, 0.3, q[rows], ks, vs, slot_offs, q_offsets=q_offsets, q_start=q_start, kv_lengths=lengths.float()
        )
    # Unchecked (as on CUDA): lengths past the slot or negative read no other sequence's rows.
    bad = torch.tensor([1000, 0, 70, -5])
    got = triton_delta_hstu_mha(
        q[rows], ks, vs, slot_offs, q_offsets, q_start, alpha=0.3, out_scale=1 / 80, kv_lengths=bad
    )
    want = triton_delta_hstu_mha(
        q[rows],
        ks,
        vs,
        slot_offs,
        q_offsets,
        q_start,
        alpha=0.3,
        out_scale=1 / 80,
        kv_lengths=torch.tensor([40, 0, 70, 0]),
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "bad_kv, bad_q",
    [
        ([0, 40, 40, 110, 119], [0, 30, 30, 80, 89]),  # valid: the safe copies equal them
        ([0, 60, 20, 130, 119], [0, 30, 30, 80, 89]),  # key offsets decrease, then pass the keys' end
        ([-9, 40, 40, 110, 200], [0, 50, 10, 95, 89]),  # negative first, last past the end; query offsets too
        ([0, 40, 40, 110, 119], [3, 30, 29, 80, 70]),  # query offsets neither start at 0 nor end at the rows
    ],
)
def test_offsets_that_break_the_rules_keep_the_delta_kernel_inside_its_buffers(bad_kv, bad_q):
    # On CUDA delta_hstu_mha reads no offsets (no sync): the kernel follows safe copies (clamped, non-decreasing,
    # 0 first, the rows last). In bounds (the interpreter raises on an out-of-bounds access) and equal to the
    # reference on the safe offsets.
    from flexhstu.ops.pytorch.delta_reference import pytorch_delta_hstu_mha
    from flexhstu.ops.triton.block_tables import safe_offsets

    q, k, v, _, rows, _, q_start = batch()
    bad_kv, bad_q = torch.tensor(bad_kv), torch.tensor(bad_q)
    got = triton_delta_hstu_mha(q[rows], k, v, bad_kv, bad_q, q_start, alpha=0.3, out_scale=1 / 80)
    safe_kv, safe_q = safe_offsets(bad_kv, k.shape[0]), safe_offsets(bad_q, rows.numel())
    assert safe_kv[0] == 0 and safe_kv[-1] == k.shape[0] and (safe_kv.diff() >= 0).all()
    want = pytorch_delta_hstu_mha(
        q[rows],
        k,
        v,
        safe_kv,
        safe_q,
        q_start,
        flexhstu.masks.rules.FixedRule(),
        alpha=0.3,
        scaling_seqlen=80,
        max_seq_len=200,
    )
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


TABLES = {"_safe_offsets_kernel": 2, "_block_table_kernel": 1}  # what a call makes from its offsets


def test_calls_sharing_a_delta_plan_make_the_offsets_tables_once_and_give_the_same_rows():
    # As the layers of a stack on one micro-batch: other q, k, v and masks, the same offsets.
    q, k, v, offs, rows, q_offsets, q_start = batch()
    layers = [(1.0, {}), (0.5, RULES["fixed"]), (2.0, mask_keywords("onerank", offs, rows)[1])]

    def run(plan):
        return [
            flexhstu.delta_hstu_mha(
                80, 0.3, s * q[rows], s * k, v / s, offs, q_offsets=q_offsets, q_start=q_start,
                kernel=Kernel.TRITON, delta_plan=plan, **kw,
            )
            for s, kw in layers
        ]  # fmt: skip

    with counted_launches() as alone:
        want = run(None)
    with counted_launches() as shared:
        got = run(flexhstu.DeltaPlan())
    assert alone == {name: 3 * n for name, n in TABLES.items()} | {"delta_forward_kernel": 3}
    assert shared == TABLES | {"delta_forward_kernel": 3}
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_delta_plan_builds_again_for_other_offsets_rows_or_tile():
    from flexhstu.ops.triton.config import Tile, tile_override

    q, k, v, offs, rows, q_offsets, q_start = batch()
    plan = flexhstu.DeltaPlan()

    def tables_made(k=k, v=v, offs=offs, q_offsets=q_offsets):
        """Tables the call with ``plan`` makes (0 or 1 each); its rows equal a call's without a plan, bit for bit.
        Unchecked (the CUDA path): the safe copies of offsets that do not fit depend on the rows."""
        args = (q[rows], k, v, offs, q_offsets, q_start)
        with counted_launches() as n:
            got = triton_delta_hstu_mha(*args, alpha=0.3, out_scale=1 / 80, plan=plan)
        assert torch.equal(got, triton_delta_hstu_mha(*args, alpha=0.3, out_scale=1 / 80))
        made = n["_block_table_kernel"]
        assert n == {name: made * c for name, c in TABLES.items() if made} | {"delta_forward_kernel": 1}
        return made

    assert tables_made() == 1 and tables_made() == 0
    assert tables_made(offs=offs.clone()) == 1  # another micro-batch's offsets: other tensors, maybe equal values
    other = offsets_from([40, 5, 65, 9])  # the same rows, other users
    assert tables_made(offs=other) == 1 and tables_made(offs=other) == 0
    assert tables_made(offs=other, q_offsets=offsets_from([20, 0, 60, 9])) == 1
    more = torch.cat([k, k[:11]]), torch.cat([v, v[:11]])  # 11 rows past the offsets' end: the last copy differs
    assert tables_made(*more, offs=other) == 1 and tables_made(*more, offs=other) == 0
    assert tables_made(offs=other) == 1
    with tile_override(forward=Tile(16, 16, 4, 1)):  # another query tile: another block table
        assert tables_made(offs=other) == 1
    assert tables_made(offs=other) == 1
    other.copy_(offsets_from([40, 10, 60, 9]))  # changed in place: its version counter moved
    assert tables_made(offs=other) == 1 and tables_made(offs=other) == 0


def test_a_delta_plan_and_given_tables_are_checked():
    q, k, v, offs, rows, q_offsets, q_start = batch()
    args = (80, 0.3, q[rows], k, v, offs)
    with pytest.raises(TypeError, match=r"delta_plan: expected None or a flexhstu.DeltaPlan, got AttnPlan"):
        flexhstu.delta_hstu_mha(
            *args, q_offsets=q_offsets, q_start=q_start, delta_plan=flexhstu.build_plan(offs, total=119, max_seq_len=80)
        )
    from flexhstu.ops.triton.delta_op import delta_tables
    from flexhstu.ops.triton.launch import _MODE_CAUSAL

    op = torch.ops.flexhstu.delta_hstu_mha_fwd
    fixed = (None, None, _MODE_CAUSAL, 0, 0, 0, 0.3, 1 / 80, None)  # func, num_targets, mode, ..., kv_lengths
    with pytest.raises(ValueError, match=r"q_table: expected all three \(delta_tables\) or none, got None, None"):
        op(q[rows], k, v, offs, q_offsets, q_start, *fixed, None, None, torch.zeros(7, dtype=torch.int32))
    tables = delta_tables(offs, q_offsets, 119, 89, 16)  # for 16-row query blocks, the kernel's are 32
    with pytest.raises(ValueError, match=r"q_table: expected 6 entries \(the query block table of 32-row blocks"):
        op(q[rows], k, v, offs, q_offsets, q_start, *fixed, *tables)
