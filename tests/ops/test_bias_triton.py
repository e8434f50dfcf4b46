"""The relative attention bias in the Triton kernels (flexhstu.ops.triton.bias_tables and bias_tiles) against
the reference, under TRITON_INTERPRET=1 on the CPU (or on a GPU when one is present).

The interpreter's blocks are small and unequal (32 x 16 forward, 16 x 32 backward) and its key-major split
runs in chunks of two query blocks, so these lengths cross many blocks, split ranges and (one test) the
256-row chunks the kernels rebase times in. Outputs and gradient buffers start as NaN (poisoned).
float32 and float16 only: the interpreter computes bf16 dots wrongly (tests/gpu covers bf16).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.ops.bias import RelativeBias, dense_relative_bias, time_bucket
from flexhstu.ops.plan import build_plan
from flexhstu.ops.triton import bias_tables, bias_tiles, triton_hstu_mha
from flexhstu.ops.triton.debug import poison_outputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (CPU) or a GPU",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
LENGTHS = [37, 0, 70, 16, 5]
HEADS = 2


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    with poison_outputs():
        yield


def edge_gaps(num_buckets: int, limit: float = 1e8) -> list[int]:
    """Gaps on both sides of every bucket edge below ``limit`` (the bucket changes between E - 1 and E)."""
    edges = [int(e) for e in bias_tables.bucket_edges(num_buckets)[1:-1] if e < limit]
    return sorted({g for e in edges for g in (e - 1, e, e + 1)})


def make_times(lengths, kind, seed=0, num_buckets=40):
    """int64 ``(total,)``: ``sorted`` (increasing, gaps hitting bucket edges exactly), ``unsorted`` (random, with
    repeats), ``edges`` (each sequence's consecutive gaps walk the edges, up and down), or ``wide`` (every
    other sequence spans up to ~10^15 units at edge values, in no order)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    gaps = torch.tensor(edge_gaps(num_buckets, 1e15 if kind == "wide" else 1e8))
    for n in lengths:
        if kind == "sorted":
            steps = gaps[torch.randint(0, len(gaps), (n,), generator=g)]
            t = 1_700_000_000 + torch.cumsum(steps, 0)
        elif kind == "unsorted":
            t = torch.randint(0, 10**7, (n,), generator=g)
            t[1::4] = t[0::4][: t[1::4].numel()]  # equal times: gap 0
        elif kind == "wide":
            # Sequences alternate: times spanning far more than 2^31 - 1 units in one 256-row chunk (steps from
            # the bucket edges, up to ~10^15, in no order: the exact int64 path) and narrow ones (the int32 path).
            if len(out) % 2 == 0:
                t = 1_700_000_000_000 + gaps[torch.randint(0, len(gaps), (n,), generator=g)]
                t[1::4] = t[0::4][: t[1::4].numel()]  # equal times: gap 0
            else:
                t = 1_700_000_000 + torch.cumsum(gaps[torch.randint(0, 8, (n,), generator=g)], 0)
        elif kind == "epoch-ns":
            # Nanoseconds since 1970 (~1.7e18, far above 2^53): narrow chunks whose float64 bases would round.
            t = 1_700_000_000_000_000_000 + torch.cumsum(gaps[torch.randint(0, len(gaps), (n,), generator=g)], 0)
        elif kind == "extreme":
            # Times at both ends of int64 and near 0, in no order: gaps that overflow int64 (they saturate into
            # the top bucket) beside small ones, in every tile.
            big = 2**63 - 1
            ends = torch.tensor([-big - 1, -big + 7, big - 11, big, 0, 5, -3])
            t = ends[torch.randint(0, len(ends), (n,), generator=g)]
        else:
            steps = gaps[torch.arange(n) % len(gaps)] * torch.where(torch.arange(n) % 3 == 2, -1, 1)
            t = 10**9 + torch.cumsum(steps, 0)
        out.append(t)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def mask_case(name, offs, lengths):
    n, t = max(lengths), sum(lengths)
    g = torch.Generator().manual_seed(11)
    if name == "causal":
        return {}
    if name == "fixed":  # targets + window + contextual prefix: the closed-form rule
        return dict(num_targets=torch.tensor([min(5, L) for L in lengths]), max_attn_len=10, contextual_seq_len=3)
    if name == "sla":
        return dict(attn_func=masks.sla(offs, 20, 4))
    if name == "onerank":
        return dict(attn_func=masks.onerank(offs, torch.tensor([(L // 3) // 4 * 4 for L in lengths]), 4))
    if name == "random-per-head":
        return dict(attn_func=torch.randint(-3, n + 3, (HEADS, 5, t), generator=g, dtype=torch.int32))
    raise KeyError(name)


def inputs(lengths, *, per_head, positions, num_buckets, dtype=torch.float32, seed=0, times="sorted", dim=16):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, HEADS, dim, generator=g) for _ in range(3))
    lead = (HEADS,) if per_head else ()
    pos_w = torch.randn(*lead, 2 * positions - 1, generator=g) * 0.7
    ts_w = torch.randn(*lead, num_buckets + 1, generator=g) * 0.7
    qkv = [x.to(DEVICE, dtype).requires_grad_(True) for x in (q, k, v)]
    tables = [x.to(DEVICE).requires_grad_(True) for x in (pos_w, ts_w)]
    return qkv, tables, make_times(lengths, times, seed, num_buckets).to(DEVICE)


def assert_all_close(got, want, names, rtol, atol):
    for g, w, name in zip(got, want, names):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def check_against_reference(
    lengths,
    mask,
    *,
    per_head,
    positions,
    num_buckets,
    dtype=torch.float32,
    times="sorted",
    alpha=0.3,
    scaling=50,
    dim=16,
    row_scale=False,
):
    offs = offsets_from(lengths).to(DEVICE)
    kw = {
        k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in mask_case(mask, offs.cpu(), lengths).items()
    }
    (q, k, v), (pos_w, ts_w), ts = inputs(
        lengths, per_head=per_head, positions=positions, num_buckets=num_buckets, dtype=dtype, times=times, dim=dim
    )
    bias = RelativeBias(pos_w, ts_w, ts)
    n = max(lengths)
    if row_scale:  # one factor per query row in place of 1 / scaling, signs and sizes mixed around its size
        g = torch.Generator().manual_seed(5)
        kw["attn_scale"] = ((torch.rand(sum(lengths), generator=g) * 4 - 1) / scaling).to(DEVICE)
    else:
        kw["scaling_seqlen"] = scaling
    out = flexhstu.hstu_mha(n, alpha, q, k, v, offs, rel_bias=bias, kernel=Kernel.TRITON, **kw)
    # The reference in float32 from the same (possibly half) inputs.
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    ref = flexhstu.hstu_mha(
        n,
        alpha,
        *leaves[:3],
        offs,
        rel_bias=RelativeBias(*leaves[3:], ts),
        kernel=Kernel.PYTORCH,
        **kw,
    )
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    assert_all_close([out.float()], [ref], ["out"], **tol)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, pos_w, ts_w), dout)
    want = torch.autograd.grad(ref, leaves, dout.float())
    assert_all_close([x.float() for x in got], want, ["dq", "dk", "dv", "dpos_w", "dts_w"], **tol)
    assert want[3].abs().sum() > 0 and want[4].abs().sum() > 0  # both tables really used
    return got


@pytest.mark.parametrize("mask", ["causal", "fixed", "sla", "onerank", "random-per-head"])
def test_shared_tables_match_the_reference_under_every_mask(mask):
    # P = 12 is shorter than the longest sequence (70): far relative positions take the table's end entries.
    check_against_reference(LENGTHS, mask, per_head=False, positions=12, num_buckets=40)


@pytest.mark.parametrize("mask", ["causal", "sla", "random-per-head"])
def test_per_head_tables_and_unsorted_times_match_the_reference(mask):
    check_against_reference(LENGTHS, mask, per_head=True, positions=80, num_buckets=40, times="unsorted")


@pytest.mark.parametrize("num_buckets", [1, 3, 128])
def test_gaps_on_bucket_edges_and_any_number_of_buckets(num_buckets):
    # Consecutive gaps walk every edge (E - 1, E, E + 1), both ways; 128 buckets is the STU layer's default.
    check_against_reference([45, 23], "causal", per_head=False, positions=30, num_buckets=num_buckets, times="edges")


def test_gaps_on_bucket_edges_under_a_mask_function_with_per_head_tables():
    # A mask function's dK/dV kernel sums the time gradients per bucket in tiles of many buckets
    # (bias_tiles._bucket_grads), which the causal kernel does not: every edge's both sides, per-head tables.
    check_against_reference([45, 23], "random-per-head", per_head=True, positions=30, num_buckets=128, times="edges")


@pytest.mark.parametrize("mask", ["causal", "sla"])
def test_a_per_row_attn_scale_scales_the_table_gradients_row_by_row(mask):
    # The tables' gradients are sums of dS, which the rows' factors scale (inside the kernel that reduces them).
    check_against_reference(LENGTHS, mask, per_head=True, positions=30, num_buckets=40, row_scale=True)


def test_half_precision_inputs():
    check_against_reference(LENGTHS, "sla", per_head=True, positions=40, num_buckets=40, dtype=torch.float16)


def test_head_dim_not_a_power_of_two_and_other_scales():
    check_against_reference(
        [33, 18], "causal", per_head=False, positions=5, num_buckets=10, alpha=1.3, scaling=7, dim=24
    )


def test_sequences_longer_than_a_time_chunk():
    # 300 rows: tiles whose rows and keys lie in different 256-row chunks (different time bases).
    check_against_reference([300], "sla", per_head=False, positions=400, num_buckets=60, times="unsorted")


@pytest.mark.parametrize("times", ["edges", "wide"])
def test_the_kernel_bias_equals_the_dense_reference_bias(times):
    """The bias the kernels add, read back through a test kernel, against dense_relative_bias, both tile
    orientations, on tiles that cross the chunks and every relative position and bucket edge (``edges``), or
    with a sequence whose chunks span more than int32 (``wide``): with and without the int64 path compiled in
    (the kernels compile it in only for sequences with a wide chunk, ``Bias.seq_wide``)."""
    # Wide times in no order: every tile walks most of the 128 buckets, slow in the interpreter; a shorter first
    # sequence (the edges case crosses the chunks).
    lengths = [300 if times == "edges" else 50, 7, 0, 40]
    offs = offsets_from(lengths).to(DEVICE)
    total, n = sum(lengths), max(lengths)
    g = torch.Generator().manual_seed(1)
    pos_w = torch.randn(HEADS, 2 * 9 - 1, generator=g).to(DEVICE)  # P = 9: most pairs clamp
    buckets = 128 if times == "wide" else 60  # 128: gaps past 2^31 have buckets of their own
    ts_w = torch.randn(HEADS, buckets + 1, generator=g).to(DEVICE)
    rel = RelativeBias(pos_w, ts_w, make_times(lengths, times, num_buckets=buckets).to(DEVICE))
    want = dense_relative_bias(rel, offs, n)  # (B, H, n, n)
    prep = bias_tables.prepare(rel, offs.to(torch.int64).contiguous(), total, with_grads=False)
    wide = prep.args.seq_wide.tolist()
    assert wide == ([1, 0, 0, 0] if times == "wide" else [0, 0, 0, 0])
    # The narrow sequences of the wide case also run with the int64 path compiled in (its int32 branch).
    for trans, with_wide in itertools.product((False, True), (False, True) if times == "wide" else (False,)):
        got = torch.full((len(lengths), HEADS, n, n), float("nan"), device=DEVICE)
        grid = (len(lengths), triton.cdiv(n, 32), HEADS)
        _bias_probe_kernel[grid + ()](prep.args, offs, got, n, BM=32, BN=16, TRANS=trans, WIDE=with_wide)
        for b, length in enumerate(lengths):
            if wide[b] and not with_wide:
                continue  # the kernels never run a sequence with a wide chunk without the int64 path
            # The kernel adds the lowest bucket's weight and then the steps between the tile's buckets: the same
            # value up to float32 rounding of those steps (a few ulp of the weights, which are ~N(0, 1) here). A
            # wrong bucket or position is off by O(1).
            torch.testing.assert_close(got[b, :, :length, :length], want[b, :, :length, :length], rtol=1e-5, atol=1e-5)


@triton.jit
def _bias_probe_kernel(bias, OFFS, OUT, n, BM: tl.constexpr, BN: tl.constexpr, TRANS: tl.constexpr, WIDE: tl.constexpr):
    """Writes the bias of query block ``program_id(1)`` of sequence ``program_id(0)``, key block by key block."""
    b = tl.program_id(0)
    h = tl.program_id(2)
    seq_start = tl.load(OFFS + b)
    L = (tl.load(OFFS + b + 1) - seq_start).to(tl.int32)
    m0 = tl.program_id(1) * BM
    if m0 < L:
        rows = m0 + tl.arange(0, BM)
        ai, amin, amax, base_a, _ = bias_tiles.bias_rows(bias, b, seq_start, L, rows, m0)
        for n0 in range(0, L, BN):
            cols = n0 + tl.arange(0, BN)
            bi, bmin, bmax, base_b = bias_tiles.bias_cols(bias, b, seq_start, L, cols, n0)
            d = base_a - base_b
            b_lo, b_hi, sgn = bias_tiles.tile_buckets(bias, amin, amax, bmin, bmax, d)
            ok = (rows[:, None] < L) & (cols[None, :] < L)
            out = OUT + ((b * tl.num_programs(2) + h) * n + rows[:, None]) * n + cols[None, :]
            if TRANS:
                zero = tl.zeros((BN, BM), tl.float32)
                t = bias_tiles.add_bias(
                    zero, bias, h, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, True, WIDE, "tf32"
                )
                tl.store(out, tl.trans(t), mask=ok)
            else:
                zero = tl.zeros((BM, BN), tl.float32)
                t = bias_tiles.add_bias(
                    zero, bias, h, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, False, WIDE, "tf32"
                )
                tl.store(out, t, mask=ok)


def test_bucket_edges_reproduce_the_reference_bucket_of_every_gap_around_them():
    for nb in (1, 10, 128, 200):
        edges = bias_tables.bucket_edges(nb)
        assert len(edges) == nb + 2 and edges[0] == -1 and math.isinf(edges[-1])
        finite = [int(e) for e in edges[1:-1] if e < 2**53]
        gaps = torch.tensor(sorted({x for e in finite for x in (e - 1, e, e + 1)} | {0, 1, 2**40}))
        counted = (gaps[:, None].double() >= torch.tensor(edges[1:-1], dtype=torch.float64)[None, :]).sum(1)
        assert torch.equal(counted, time_bucket(gaps, nb)), nb
        assert torch.equal(counted, time_bucket(-gaps, nb)), nb  # |gap|


class _Edges(NamedTuple):
    """What ``bias_tiles.bucket_of`` reads of a ``bias_tables.Bias``."""

    edges: torch.Tensor
    num_buckets: int


@triton.jit
def _bucket_probe_kernel(edges, X, OUT, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0.0)
    tl.store(OUT + i, bias_tiles.bucket_of(edges, x), mask=i < n)


def test_bucket_of_is_the_reference_bucket_of_every_gap_around_the_edges_and_up_to_int64s():
    """``bucket_of`` (the tiles' bucket range: an estimate from the float64 bits of a gap, then one comparison
    with each neighbouring edge) of float64 gaps: both sides of every edge, 0, 1, and log-uniform gaps up to
    2^63. An estimate off by two, or a correction that went the wrong way, moves some bucket."""
    g = torch.Generator().manual_seed(0)
    for nb in (1, 10, 60, 128, 200):
        edges = bias_tables.edges_tensors(nb, torch.device(DEVICE))[0]
        random = torch.exp(torch.rand(20000, generator=g, dtype=torch.float64) * 63 * math.log(2)).to(torch.int64)
        gaps = torch.cat([torch.tensor(edge_gaps(nb, 2**53) + [0, 1, 2, 2**62, 2**63 - 1]), random.clamp(min=0)])
        got = torch.full(gaps.shape, -1, dtype=torch.int32, device=DEVICE)
        x = gaps.to(torch.float64).to(DEVICE)
        _bucket_probe_kernel[(triton.cdiv(len(gaps), 1024),)](_Edges(edges, nb), x, got, len(gaps), BLOCK=1024)
        assert torch.equal(got.cpu().to(torch.int64), time_bucket(gaps, nb)), nb


class _PairEdges(NamedTuple):
    """What ``bias_tiles._pair_buckets`` reads of a ``bias_tables.Bias``."""

    edges32: torch.Tensor
    num_buckets: int


@triton.jit
def _pair_bucket_probe_kernel(edges, AI, BI, D, OUT, BM: tl.constexpr, BN: tl.constexpr, TRANS: tl.constexpr):
    i = tl.program_id(0) * BM + tl.arange(0, BM)
    ai = tl.load(AI + i)
    bi = tl.load(BI + tl.arange(0, BN))
    b = bias_tiles._pair_buckets(edges, ai, bi, tl.load(D), TRANS, "tf32")  # d: float64, as tiles have it
    if TRANS:  # (keys, rows)
        tl.store(OUT + i[None, :] * BN + tl.arange(0, BN)[:, None], b)
    else:
        tl.store(OUT + i[:, None] * BN + tl.arange(0, BN)[None, :], b)


@pytest.mark.parametrize("trans", [False, True])
def test_pair_buckets_are_the_reference_bucket_of_every_int32_gap(trans):
    """``_pair_buckets`` (each pair's bucket in the tiles of many buckets: the gap in int32 modulo 2^32, an
    estimate from its float32 bits, one edge load to raise it): both sides of every edge below 2^31 - 1 (the
    estimate is non-decreasing, so ``E - 1`` and ``E`` of every edge bound it everywhere), 0, 1 and log-uniform
    gaps, of both signs, with base differences ``d`` of 0 and beyond int32 (the int32 offsets then differ by
    about the gap minus ``d``). An estimate above the bucket or two below, or an overflow in the fixed-point
    estimate, moves some bucket."""
    g = torch.Generator().manual_seed(1)
    bm, bn = 64, 16
    cols = torch.arange(bn, dtype=torch.int64)
    for nb in (1, 10, 60, 128):
        edges32 = bias_tables.edges_tensors(nb, torch.device(DEVICE))[1]
        random = torch.exp(torch.rand(4000, generator=g, dtype=torch.float64) * 31 * math.log(2)).to(torch.int64)
        targets = torch.cat([torch.tensor(edge_gaps(nb, 2**31 - 64) + [0, 1, 2, 3]), random.clamp(max=2**31 - 64)])
        for d, sign in ((0, 1), (0, -1), (3 * 10**9, 1), (-(3 * 10**9), -1), (2**31 - 5, 1)):
            gaps = sign * targets
            # Offsets: the keys' times 2^30 + j (j < bn), the rows' such that row i's gap to key 0 is gaps[i].
            keep = ((gaps - d + 2**30) >= 0) & ((gaps - d + 2**30) < 2**31 - 1) & ((gaps - bn).abs() < 2**31 - 1)
            rows = gaps[keep]
            rows = torch.cat([rows, rows[-1:].expand((-len(rows)) % bm)])
            ai = (rows - d + 2**30).to(torch.int32)
            bi = (2**30 + cols).to(torch.int32)
            want = time_bucket(rows[:, None] - cols[None, :], nb)
            got = torch.full((len(rows), bn), -1, dtype=torch.int32, device=DEVICE)
            _pair_bucket_probe_kernel[(len(rows) // bm,)](
                _PairEdges(edges32, nb),
                ai.to(DEVICE),
                bi.to(DEVICE),
                torch.tensor([float(d)], dtype=torch.float64, device=DEVICE),
                got,
                BM=bm,
                BN=bn,
                TRANS=trans,
            )
            assert torch.equal(got.cpu().to(torch.int64), want), (nb, d, sign)


def test_a_plan_with_the_bias_gives_the_plan_free_result():
    lengths = LENGTHS
    offs = offsets_from(lengths).to(DEVICE)
    total, n = sum(lengths), max(lengths)
    func = masks.sla(offs.cpu(), 20, 4).to(DEVICE)
    plan = build_plan(offs, total=total, max_seq_len=n, attn_func=func)
    (q, k, v), (pos_w, ts_w), ts = inputs(lengths, per_head=False, positions=20, num_buckets=30)
    rel = RelativeBias(pos_w, ts_w, ts)
    common = dict(func=func, alpha=0.3, out_scale=1 / 50, max_seq_len=n, rel_bias=rel)
    results = []
    for p in (plan, None):
        out = triton_hstu_mha(q, k, v, offs, plan=p, **common)
        out2 = triton_hstu_mha(out + q, k, v, offs, plan=p, **common)  # a second layer on the same plan
        results.append((out2, *torch.autograd.grad(out2, (q, k, v, pos_w, ts_w), torch.ones_like(out2))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_seq_len", [0, 10_000])
def test_max_seq_len_is_only_a_hint_with_the_bias(max_seq_len):
    # The key-major split (chunks of 2 query blocks here) adds partial table gradients from several programs.
    lengths = [100, 0, 45]
    offs = offsets_from(lengths).to(DEVICE)
    (q, k, v), (pos_w, ts_w), ts = inputs(lengths, per_head=True, positions=50, num_buckets=30)
    rel = RelativeBias(pos_w, ts_w, ts)
    func = masks.sla(offs.cpu(), 40, 8).to(DEVICE)
    out = triton_hstu_mha(q, k, v, offs, func=func, alpha=0.3, out_scale=1 / 100, max_seq_len=max_seq_len, rel_bias=rel)
    ref = flexhstu.hstu_mha(100, 0.3, q, k, v, offs, attn_func=func, rel_bias=rel, kernel=Kernel.PYTORCH)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    leaves = (q, k, v, pos_w, ts_w)
    assert_all_close(
        torch.autograd.grad(out, leaves, dout),
        torch.autograd.grad(ref, leaves, dout),
        ["dq", "dk", "dv", "dpos_w", "dts_w"],
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_eager_and_compiled_paths_give_the_table_gradients(compiled):
    lengths = [37, 0, 21]
    offs = offsets_from(lengths).to(DEVICE)
    (q, k, v), (pos_w, ts_w), ts = inputs(lengths, per_head=False, positions=10, num_buckets=20)

    def attention(q, k, v, pos_w, ts_w, kernel):
        return flexhstu.hstu_mha(37, None, q, k, v, offs, rel_bias=RelativeBias(pos_w, ts_w, ts), kernel=kernel)

    run = torch.compile(attention, fullgraph=True, backend="aot_eager") if compiled else attention
    out = run(q, k, v, pos_w, ts_w, Kernel.TRITON)
    ref = attention(q, k, v, pos_w, ts_w, Kernel.PYTORCH)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    leaves = (q, k, v, pos_w, ts_w)
    assert_all_close(
        torch.autograd.grad(out, leaves, dout),
        torch.autograd.grad(ref, leaves, dout),
        ["dq", "dk", "dv", "dpos_w", "dts_w"],
        rtol=1e-4,
        atol=1e-5,
    )


def test_tables_without_grad_get_none_and_the_rest_is_unchanged():
    lengths = [37, 21]
    offs = offsets_from(lengths).to(DEVICE)
    (q, k, v), (pos_w, ts_w), ts = inputs(lengths, per_head=True, positions=10, num_buckets=20)
    frozen = RelativeBias(pos_w.detach(), ts_w.detach(), ts)
    out = flexhstu.hstu_mha(37, None, q, k, v, offs, rel_bias=frozen, kernel=Kernel.TRITON)
    ref = flexhstu.hstu_mha(37, None, q, k, v, offs, rel_bias=frozen, kernel=Kernel.PYTORCH)
    dout = torch.randn_like(out)
    assert_all_close(
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(ref, (q, k, v), dout),
        ["dq", "dk", "dv"],
        rtol=1e-4,
        atol=1e-5,
    )


def test_an_empty_batch_gives_zero_table_gradients():
    q, k, v = (torch.zeros(0, HEADS, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    pos_w = torch.randn(5, device=DEVICE, requires_grad=True)
    ts_w = torch.randn(HEADS, 4, device=DEVICE, requires_grad=True)
    rel = RelativeBias(pos_w, ts_w, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    out = flexhstu.hstu_mha(4, None, q, k, v, offsets_from([0, 0]).to(DEVICE), rel_bias=rel, kernel=Kernel.TRITON)
    dpos, dts = torch.autograd.grad(out.sum(), (pos_w, ts_w))
    assert (dpos == 0).all() and (dts == 0).all() and dts.shape == ts_w.shape


@pytest.mark.parametrize("times", ["epoch-ns", "extreme"])
def test_any_int64_times_are_exact(times):
    # Absolute times past 2^53 (float64 bases would round) and times whose gaps overflow int64: 150 buckets, so
    # the top buckets (reached only by gaps past 2^62) and the unreachable ones (edges past 2^63) are there too.
    check_against_reference([45, 23, 38], "causal", per_head=False, positions=50, num_buckets=150, times=times)


@pytest.mark.parametrize("mask", ["causal", "sla"])
def test_chunks_spanning_more_than_int32_time_units_are_exact(mask):
    # Millisecond-like times whose 256-row chunks span up to ~10^15 units (int32 offsets cannot hold them) beside
    # narrow sequences: the tiles of wide chunks take the int64 path, the others the int32 one; 128 buckets, so
    # gaps above 2^31 land in buckets 72-128 and must be told apart exactly.
    check_against_reference([45, 23, 38], mask, per_head=False, positions=50, num_buckets=128, times="wide")


def test_the_bias_tiles_of_the_gpu_match_the_reference():
    # The GPU's tiles for calls with a bias: dK/dV 32 query rows x 64 keys (its diagonal sums cut the tile into
    # 8 x 8 sub-blocks, a shape the interpreter's own tiles, 4 x 4, never reach), and at D <= 64 forward and dQ
    # tiles of 64 x 64.
    from flexhstu.ops.triton.config import Tile, default_tiles, tile_override

    gpu = default_tiles(128, 128, interpreting=False, bias=True)
    assert gpu.dkdv == Tile(32, 64, 4, 2)
    assert gpu._replace(dkdv=None) == default_tiles(128, 128, interpreting=False)._replace(dkdv=None)
    assert default_tiles(128, 128, interpreting=False, sparse=True, bias=True).dkdv == Tile(32, 64, 4, 2)
    small = default_tiles(32, 64, interpreting=False, bias=True)  # D <= 64: 64 x 64 forward and dQ tiles too
    assert small.forward == small.dq == Tile(64, 64, 4, 3) and small.dkdv == Tile(32, 64, 4, 2)
    one_stage = {name: dataclasses.replace(t, num_stages=1) for name, t in small._asdict().items()}
    with tile_override(**one_stage):
        check_against_reference([70, 0, 33], "sla", per_head=False, positions=40, num_buckets=40)


def test_block_summaries_bound_every_aligned_block_of_every_sequence():
    """Each summary slot holds the min and max of the int32 times and next times of its block's rows (a
    wrong slot or a row of the next sequence counted in makes a tile's bucket range miss pairs' buckets)."""
    lengths = [300, 0, 17, 256, 513]
    offs = offsets_from(lengths).to(torch.int64)
    total = sum(lengths)
    rel = RelativeBias(
        torch.zeros(9, device=DEVICE), torch.zeros(41, device=DEVICE), make_times(lengths, "unsorted").to(DEVICE)
    )
    a = bias_tables.prepare(rel, offs.to(DEVICE), total, with_grads=False).args
    a = a._replace(summary=a.summary.cpu(), time32=a.time32.cpu(), next32=a.next32.cpu())
    chunk_rows, slots = bias_tables.CHUNK, bias_tables.SUMMARY_SLOTS
    checked = 0
    for b, n in enumerate(lengths):
        start = int(offs[b])
        for bs in (16, 32, 64, 128, 256):
            for p0 in range(0, n, bs):
                chunk = start // chunk_rows + b + p0 // chunk_rows
                slot = chunk * slots + slots - 2 * chunk_rows // bs + (p0 % chunk_rows) // bs
                rows = slice(start + p0, start + min(p0 + bs, n))
                got = a.summary.view(-1, 4)[slot].tolist()
                t, nx = a.time32[rows], a.next32[rows]
                assert got == [t.min(), -t.max(), nx.min(), -nx.max()], (b, bs, p0)
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("times", ["sorted", "unsorted", "wide", "edges"])
def test_the_two_launch_prepare_equals_the_torch_definition_bit_for_bit(times):
    """bias_prepare's kernels against bias_tables.chunked_times: every per-row offset, base (NaN where wide),
    next time, wide flag and summary slot, on sequences of 0, 1, 255, 256, 257 and 600 rows."""
    from flexhstu.ops.triton.bias_prepare import chunked_times_triton

    lengths = [257, 0, 1, 600, 255, 0, 256]
    offs = offsets_from(lengths).to(torch.int64).to(DEVICE)
    total = sum(lengths)
    ts = make_times(lengths, times, num_buckets=128 if times == "wide" else 40).to(DEVICE)
    want = bias_tables.chunked_times(ts, offs, total)
    got = chunked_times_triton(
        ts,
        offs,
        total,
        bias_tables.CHUNK,
        bias_tables.SUMMARY_GRAIN,
        bias_tables.SUMMARY_SLOTS,
        bias_tables.INT32_SPAN,
        bias_tables.BASE_SPAN,
    )
    names = ("time32", "time_base", "next32", "next_base", "next64", "seq_wide", "summary")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), name
            a, b = a.nan_to_num(), b.nan_to_num()
        assert torch.equal(a, b), name
    if times == "wide":
        assert bool(want[5].any()), "the wide case holds a wide sequence"


def test_the_two_launch_prepare_follows_safe_offsets_when_given_bad_ones():
    """Offsets past ``total`` (unchecked on CUDA, where validating them would need a sync): the preparation
    follows the clamped offsets the attention kernels follow, so no program writes outside its buffers."""
    from flexhstu.ops.triton.bias_prepare import chunked_times_triton
    from flexhstu.ops.triton.block_tables import safe_offsets

    total = 300
    bad = torch.tensor([0, 290, 600], dtype=torch.int64, device=DEVICE)
    ts = make_times([290, 10], "unsorted").to(DEVICE)
    consts = (bias_tables.CHUNK, bias_tables.SUMMARY_GRAIN, bias_tables.SUMMARY_SLOTS)
    got = chunked_times_triton(ts, bad, total, *consts, bias_tables.INT32_SPAN, bias_tables.BASE_SPAN)
    want = bias_tables.chunked_times(ts, safe_offsets(bad, total), total)
    for a, b in zip(got, want):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
