"""The relative attention bias of hstu_mha(PYTORCH) against an independent per-pair float64 reading of its rule."""

from __future__ import annotations

import math

import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.bias import RelativeBias, dense_relative_bias

LENGTHS = [7, 0, 11, 4]
HEADS = 2


def bucket_of(gap: int, num_buckets: int) -> int:
    """The published bucket, read with Python's math: floor(ln(max(|gap|, 1)) / 0.301), clamped."""
    return min(max(math.floor(math.log(max(abs(gap), 1)) / 0.301), 0), num_buckets)


def pair_bias(pos_w, ts_w, ts: list[int], h: int):
    """(L, L) bias of one sequence and head, entry by entry: positions clamp to the table, the last row uses its
    own time."""
    length = len(ts)
    pw = pos_w[h] if pos_w.dim() == 2 else pos_w
    tw = ts_w[h] if ts_w.dim() == 2 else ts_w
    half = (pw.shape[0] - 1) // 2
    nb = tw.shape[0] - 1
    rows = []
    for i in range(length):
        nxt = ts[i + 1] if i + 1 < length else ts[i]
        rows.append(
            torch.stack(
                [pw[min(max(j - i + half, 0), 2 * half)] + tw[bucket_of(nxt - ts[j], nb)] for j in range(length)]
            )
        )
    return torch.stack(rows) if rows else pw.new_zeros(0, 0)


def attention_f64(q, k, v, lengths, vis, alpha, scale, bias_of):
    """Per-sequence float64 HSTU attention with ``bias_of(b, h, start, L) -> (L, L)`` added to the scores."""
    outs, start = [], 0
    for b, length in enumerate(lengths):
        qb, kb, vb = (x[start : start + length].double() for x in (q, k, v))
        heads = []
        for h in range(q.shape[1]):
            s = qb[:, h] @ kb[:, h].T * alpha + bias_of(b, h, start, length).double()
            m = vis[b, h if vis.shape[1] > 1 else 0, :length, :length]
            heads.append(torch.where(m, s * torch.sigmoid(s), 0.0) / scale @ vb[:, h])
        outs.append(torch.stack(heads, dim=1) if heads else vb.new_zeros(length, 0, v.shape[2]))
        start += length
    return torch.cat(outs)


def funcs(lengths):
    offs = offsets_from(lengths)
    g = torch.Generator().manual_seed(3)
    return {
        "causal": masks.causal(offs),
        "sla": masks.sla(offs, 3, 2, num_targets=torch.tensor([min(2, n) for n in lengths])),
        "onerank": masks.onerank(offs, torch.tensor([(n // 3) // 3 * 3 for n in lengths]), 3),
        "random-per-head": torch.randint(
            -1, max(lengths) + 2, (HEADS, 5, sum(lengths)), generator=g, dtype=torch.int32
        ),
    }


def make_inputs(lengths, *, per_head, positions, num_buckets, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, HEADS, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(total, HEADS, 6, generator=g, dtype=torch.float64)
    lead = (HEADS,) if per_head else ()
    pos_w = torch.randn(*lead, 2 * positions - 1, generator=g, dtype=torch.float64)
    ts_w = torch.randn(*lead, num_buckets + 1, generator=g, dtype=torch.float64)
    # Gaps from 0 to ~1e5 both ways (unsorted times): small buckets, the clamped last one, equal times.
    ts = torch.randint(0, 100_000, (total,), generator=g)
    ts[1::3] = ts[0::3][: ts[1::3].numel()]
    return [x.requires_grad_(True) for x in (q, k, v, pos_w, ts_w)], ts


@pytest.mark.parametrize("name", ["causal", "sla", "onerank", "random-per-head"])
@pytest.mark.parametrize("per_head,positions,num_buckets", [(False, 5, 8), (True, 16, 40)])
def test_forward_and_gradients_match_per_pair_float64(name, per_head, positions, num_buckets):
    # positions=5 is shorter than the longest sequence (11): relative positions beyond +-4 take the table's ends.
    offs, n = offsets_from(LENGTHS), max(LENGTHS)
    func = funcs(LENGTHS)[name]
    (q, k, v, pos_w, ts_w), ts = make_inputs(LENGTHS, per_head=per_head, positions=positions, num_buckets=num_buckets)
    out = flexhstu.hstu_mha(
        n,
        0.37,
        q,
        k,
        v,
        offs,
        attn_func=func,
        scaling_seqlen=9,
        rel_bias=RelativeBias(pos_w, ts_w, ts),
        kernel=Kernel.PYTORCH,
    )
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    qr, kr, vr, pr, tr = leaves
    times = ts.tolist()
    ref = attention_f64(
        qr,
        kr,
        vr,
        LENGTHS,
        masks.to_dense(func, offs, n),
        0.37,
        9.0,
        lambda b, h, start, length: pair_bias(pr, tr, times[start : start + length], h),
    )
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, pos_w, ts_w), dout)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert ref_grads[3].abs().sum() > 0 and ref_grads[4].abs().sum() > 0  # both tables are really used


def test_last_row_uses_its_own_time_and_never_the_next_sequence():
    # Two sequences; the second starts at a huge time the first's last row must not read.
    ts = torch.tensor([0, 10, 1000, 10**9, 10**9 + 3])
    offs = offsets_from([3, 2])
    bias = RelativeBias(torch.zeros(5), torch.arange(61.0), ts)
    got = dense_relative_bias(bias, offs, 3)[:, 0]  # (B, n, n): the bucket of each pair, as a float
    # Row i reads next = ts[i + 1] inside the sequence, its own ts[i] on the last row.
    want0 = [
        [bucket_of(10 - t, 60) for t in (0, 10, 1000)],
        [bucket_of(1000 - t, 60) for t in (0, 10, 1000)],
        [bucket_of(1000 - t, 60) for t in (0, 10, 1000)],
    ]
    want1 = [[bucket_of(3 - t, 60) for t in (0, 3)], [bucket_of(3 - t, 60) for t in (0, 3)]]
    assert got[0].tolist() == want0
    assert got[1, :2, :2].tolist() == want1
    assert want0[2] == [22, 22, 0] and want1[0] == [3, 0]  # ln(1000) / 0.301 = 22.9; ln(3) / 0.301 = 3.6


def test_bucket_edges_follow_the_log_scale_and_clamp():
    nb = 10
    bias = RelativeBias(torch.zeros(3), torch.arange(nb + 1.0), torch.tensor([0, 0]))
    for gap, want in [(0, 0), (1, 0), (-1, 0), (2, 2), (-2, 2), (3, 3), (4, 4), (20, 9), (30, 10), (10**12, 10)]:
        bias = bias._replace(timestamps=torch.tensor([0, gap]))
        got = dense_relative_bias(bias, offsets_from([2]), 2)[0, 0]
        assert got[0, 0].item() == want == bucket_of(gap, nb), gap  # row 0 reads next = gap, key 0 is at time 0


def test_gaps_beyond_int64_saturate_into_the_top_bucket():
    # Times at both ends of int64: their differences overflow; the gap saturates at 2^63 - 1 (bucket 145 of 200)
    # instead of wrapping around to a small one.
    big = 2**63 - 1
    times = [-big - 1, big, 0, -5, big - 3]
    bias = RelativeBias(torch.zeros(9), torch.arange(201.0), torch.tensor(times))
    got = dense_relative_bias(bias, offsets_from([5]), 5)[0, 0]
    nexts = times[1:] + times[-1:]
    want = [[float(bucket_of(max(min(a - b, big), -big), 200)) for b in times] for a in nexts]
    assert got.tolist() == want
    assert want[0][0] == 145.0 and want[1][2] == 0.0  # big - (-big - 1) saturates; 0 - 0 is 0


def test_half_tables_are_summed_in_float32():
    g = torch.Generator().manual_seed(0)
    pos_w, ts_w = torch.randn(7, generator=g).half(), torch.randn(31, generator=g).half()
    ts, offs = torch.tensor([0, 7, 100, 5000]), offsets_from([4])
    got = dense_relative_bias(RelativeBias(pos_w, ts_w, ts), offs, 4)
    want = dense_relative_bias(RelativeBias(pos_w.float(), ts_w.float(), ts), offs, 4)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_dense_rab_gives_the_table_path_output_and_its_gradients():
    lengths, n = LENGTHS, 12  # max_seq_len above the longest sequence: rab is (B, H, 12, 12)
    offs = offsets_from(lengths)
    func = funcs(lengths)["sla"]
    (q, k, v, pos_w, ts_w), ts = make_inputs(lengths, per_head=True, positions=8, num_buckets=20)
    tables = flexhstu.hstu_mha(
        n, None, q, k, v, offs, attn_func=func, rel_bias=RelativeBias(pos_w, ts_w, ts), kernel=Kernel.PYTORCH
    )
    # Padded entries of rab are NaN: pairs outside a sequence must never read them.
    rab = torch.full((len(lengths), HEADS, n, n), float("nan"), dtype=torch.float64)
    starts = offs.tolist()
    for b, length in enumerate(lengths):
        for h in range(HEADS):
            rab[b, h, :length, :length] = pair_bias(pos_w, ts_w, ts[starts[b] : starts[b] + length].tolist(), h)
    rab = rab.detach().requires_grad_(True)
    dense = flexhstu.hstu_mha(n, None, q, k, v, offs, attn_func=func, rab=rab, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(dense, tables, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(dense)
    g_tab = torch.autograd.grad(tables, (q, k, v), dout)
    g_rab = torch.autograd.grad(dense, (q, k, v, rab), dout)
    for a, b in zip(g_tab, g_rab):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    d_rab = g_rab[3]
    assert torch.isfinite(d_rab).all() and d_rab.abs().sum() > 0
    vis = masks.to_dense(func, offs, n).expand(-1, HEADS, -1, -1)
    assert (d_rab[~vis] == 0).all()  # hidden and padded pairs get no gradient


def test_rab_shared_by_the_heads_equals_it_repeated_per_head():
    offs, n = offsets_from(LENGTHS), 11
    (q, k, v, _, _), _ = make_inputs(LENGTHS, per_head=False, positions=3, num_buckets=3)
    rab = torch.randn(len(LENGTHS), n, n, dtype=torch.float64)
    shared = flexhstu.hstu_mha(n, None, q, k, v, offs, rab=rab, kernel=Kernel.PYTORCH)
    repeated = flexhstu.hstu_mha(
        n, None, q, k, v, offs, rab=rab[:, None].expand(-1, HEADS, -1, -1).clone(), kernel=Kernel.PYTORCH
    )
    torch.testing.assert_close(shared, repeated, rtol=0, atol=0)
    plain = flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.PYTORCH)
    assert not torch.allclose(shared, plain)


def test_half_inputs_are_biased_in_float32():
    offs, n = offsets_from(LENGTHS), max(LENGTHS)
    (q, k, v, pos_w, ts_w), ts = make_inputs(LENGTHS, per_head=False, positions=12, num_buckets=30)
    bias = RelativeBias(pos_w.detach().float(), ts_w.detach().float(), ts)
    got = flexhstu.hstu_mha(
        n, None, *(x.detach().bfloat16() for x in (q, k, v)), offs, rel_bias=bias, kernel=Kernel.PYTORCH
    )
    want = flexhstu.hstu_mha(
        n,
        None,
        *(x.detach().bfloat16().double() for x in (q, k, v)),
        offs,
        rel_bias=RelativeBias(pos_w.detach(), ts_w.detach(), ts),
        kernel=Kernel.PYTORCH,
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-3)


def test_an_empty_batch_gives_zero_gradients_to_the_tables():
    q, k, v = (torch.zeros(0, HEADS, 4, requires_grad=True) for _ in range(3))
    pos_w, ts_w = torch.randn(5, requires_grad=True), torch.randn(4, requires_grad=True)
    out = flexhstu.hstu_mha(
        4,
        None,
        q,
        k,
        v,
        offsets_from([0, 0]),
        rel_bias=RelativeBias(pos_w, ts_w, torch.zeros(0, dtype=torch.int64)),
        kernel=Kernel.PYTORCH,
    )
    out.sum().backward()
    assert pos_w.grad is not None and (pos_w.grad == 0).all() and (ts_w.grad == 0).all()


def _bias(**change):
    base = dict(pos_w=torch.zeros(9), ts_w=torch.zeros(129), timestamps=torch.arange(8))
    return RelativeBias(**{**base, **change})


BAD = {
    "not-a-bias": (
        dict(rel_bias=(torch.zeros(9), torch.zeros(3), torch.arange(8))),
        TypeError,
        r"rel_bias: expected a flexhstu.ops.bias.RelativeBias.*got tuple",
    ),
    "pos-even": (
        dict(rel_bias=_bias(pos_w=torch.zeros(8))),
        ValueError,
        r"rel_bias.pos_w: expected an odd number 2P - 1 of relative positions, got 8",
    ),
    "pos-heads": (
        dict(rel_bias=_bias(pos_w=torch.zeros(3, 9))),
        ValueError,
        r"rel_bias.pos_w: expected shape \(n,\) shared by the heads or \(H=2, n\), got shape \(3, 9\)",
    ),
    "ts-3d": (
        dict(rel_bias=_bias(ts_w=torch.zeros(1, 2, 9))),
        ValueError,
        r"rel_bias.ts_w: expected shape .* got shape \(1, 2, 9\)",
    ),
    "ts-int": (
        dict(rel_bias=_bias(ts_w=torch.zeros(9, dtype=torch.int64))),
        TypeError,
        r"rel_bias.ts_w: expected a floating dtype, got torch.int64",
    ),
    "pos-device": (
        dict(rel_bias=_bias(pos_w=torch.zeros(9, device="meta"))),
        ValueError,
        r"rel_bias.pos_w.device: expected the device of q \(cpu\), got meta",
    ),
    "times-float": (
        dict(rel_bias=_bias(timestamps=torch.zeros(8))),
        TypeError,
        r"rel_bias.timestamps: expected an integer dtype, got torch.float32",
    ),
    "times-rows": (
        dict(rel_bias=_bias(timestamps=torch.arange(7))),
        ValueError,
        r"rel_bias.timestamps: expected one time per jagged row \(8,\), got shape \(7,\)",
    ),
    "rab-shape": (
        dict(rab=torch.zeros(2, 4, 5)),
        ValueError,
        r"rab: expected shape \(B=2, N, N\) or \(B, 1 or H=2, N, N\) with N = max_seq_len = 5, "
        r"got shape \(2, 4, 5\)",
    ),
    "rab-heads": (dict(rab=torch.zeros(2, 3, 5, 5)), ValueError, r"rab: expected shape .*got shape \(2, 3, 5, 5\)"),
    "rab-int": (
        dict(rab=torch.zeros(2, 5, 5, dtype=torch.int32)),
        TypeError,
        r"rab: expected a floating dtype, got torch.int32",
    ),
    "rab-device": (
        dict(rab=torch.zeros(2, 5, 5, device="meta")),
        ValueError,
        r"rab.device: expected the device of q \(cpu\), got meta",
    ),
    "both": (
        dict(rel_bias=_bias(), rab=torch.zeros(2, 5, 5)),
        ValueError,
        r"rab: expected None when rel_bias is given",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_bias_is_an_error_naming_the_argument(name):
    kw, err, msg = BAD[name]
    q, k, v = (torch.zeros(8, 2, 4) for _ in range(3))
    with pytest.raises(err, match=msg):
        flexhstu.hstu_mha(5, None, q, k, v, offsets_from([5, 3]), kernel=Kernel.PYTORCH, **kw)
