"""Bad input gets a clear error naming the argument, what was expected and what was given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rules import offsets_from

import flexhstu
from flexhstu import Kernel, masks


@pytest.fixture
def batch():
    offs = offsets_from([5, 3])
    q = torch.randn(8, 2, 4)
    return offs, q, q.clone(), q.clone()


def call(batch, **kw):
    offs, q, k, v = batch
    args = dict(max_seq_len=5, alpha=None, q=q, k=k, v=v, seq_offsets=offs)
    args.update(kw)
    return flexhstu.hstu_mha(**args)


CASES = [
    (
        dict(attn_func=torch.zeros(1, 1, 8, dtype=torch.int64)),
        TypeError,
        r"attn_func: expected dtype torch.int32, got torch.int64",
    ),
    (dict(attn_func=torch.zeros(1, 8, dtype=torch.int32)), ValueError, r"attn_func: expected a 3-D tensor"),
    (
        dict(attn_func=torch.zeros(1, 4, 8, dtype=torch.int32)),
        ValueError,
        r"attn_func.shape\[1\] \(NFUNC\): expected an odd width >= 1, got 4",
    ),
    (
        dict(attn_func=torch.zeros(1, 3, 7, dtype=torch.int32)),
        ValueError,
        r"attn_func.shape\[2\]: expected one column per query row \(8\), got 7",
    ),
    (
        dict(attn_func=torch.zeros(3, 3, 8, dtype=torch.int32)),
        ValueError,
        r"attn_func.shape\[0\] \(Hf\): expected 1 or the number of heads \(2\), got 3",
    ),
    (
        dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), num_targets=torch.tensor([1, 1])),
        ValueError,
        r"attn_func: .*leave num_targets at the default",
    ),
    (dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), max_attn_len=3), ValueError, r"leave max_attn_len"),
    (
        dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), contextual_seq_len=1),
        ValueError,
        r"leave contextual_seq_len",
    ),
    (dict(k=torch.randn(7, 2, 4)), ValueError, r"k.shape\[0\]: expected the rows of q \(8\), got 7"),
    (dict(v=torch.randn(8, 3, 4)), ValueError, r"v.shape\[1\] \(heads\): expected the heads of q \(2\), got 3"),
    (dict(k=torch.randn(8, 2, 6)), ValueError, r"k.shape\[2\] \(Dqk\): expected the head dim of q \(4\), got 6"),
    (dict(seq_offsets=torch.tensor([1, 5, 8])), ValueError, r"seq_offsets\[0\]: expected 0, got 1"),
    (
        dict(seq_offsets=torch.tensor([0, 6, 5, 8])),
        ValueError,
        r"seq_offsets: expected non-decreasing offsets, got seq_offsets\[2\] = 5 < seq_offsets\[1\] = 6",
    ),
    (
        dict(seq_offsets=torch.tensor([0, 5, 9])),
        ValueError,
        r"seq_offsets\[-1\]: expected the number of rows of the data \(8\), got 9",
    ),
    (dict(seq_offsets=torch.tensor([0, 5, 8.0])), TypeError, r"seq_offsets: expected dtype torch.int32 or torch.int64"),
    (
        dict(max_seq_len=4),
        ValueError,
        r"max_seq_len: expected at least every sequence length \(sequence 0 has 5\), got 4",
    ),
    (
        dict(num_targets=torch.tensor([1, 4])),
        ValueError,
        r"num_targets\[1\]: expected 0 <= T <= the sequence length 3, got 4",
    ),
    (dict(num_targets=torch.tensor([1])), ValueError, r"num_targets: expected a \(2,\) tensor"),
    (dict(dropout_pr=1.5), ValueError, r"dropout_pr: expected a probability in \[0, 1\), got 1.5"),
    (dict(q=torch.randn(8, 2, 4).long()), TypeError, r"q: expected float16, bfloat16, float32 or float64"),
    (
        dict(num_targets=torch.tensor([1.0, 1.5])),
        TypeError,
        r"num_targets: expected an integer tensor .*got torch.float32",
    ),
    (
        dict(num_targets=torch.tensor([True, False])),
        TypeError,
        r"num_targets: expected an integer tensor .*got torch.bool",
    ),
    (dict(alpha=float("nan")), ValueError, r"alpha: expected a finite number, got nan"),
    (dict(alpha=float("inf")), ValueError, r"alpha: expected a finite number, got inf"),
    (dict(alpha="0.5"), TypeError, r"alpha: expected a real number, got str"),
    # Audit: a Python float beyond float32 became inf in the kernels' float32 scale, and every output NaN.
    (dict(alpha=1e39), ValueError, r"alpha: expected a number float32 holds \(\|alpha\| <= 3.403e\+38\), got 1e\+39"),
    (dict(scaling_seqlen=float("nan")), ValueError, r"scaling_seqlen: expected a finite number, got nan"),
    (dict(scaling_seqlen=float("-inf")), ValueError, r"scaling_seqlen: expected a finite number, got -inf"),
    # 1 / 1e-300 overflows float32: every output was NaN (bad-input audit); 1 / 1e300 underflows to 0.
    (
        dict(scaling_seqlen=1e-300),
        ValueError,
        r"scaling_seqlen: expected <= 0 \(the default\) or a scale from "
        r"1e-37 to 1e\+37 .*got 1e-300",
    ),
    (dict(scaling_seqlen=1e300), ValueError, r"scaling_seqlen: expected <= 0 .*got 1e\+300"),
    # Any truthy object ran causal, None non-causal.
    (dict(causal="no"), TypeError, r"causal: expected a bool \(Python or NumPy\), got str"),
    (dict(causal=None), TypeError, r"causal: expected a bool \(Python or NumPy\), got NoneType"),
    # Audit: training="no" applied dropout, None silently turned it off.
    (dict(training="no", dropout_pr=0.5), TypeError, r"training: expected a bool \(Python or NumPy\), got str"),
    (dict(training=None), TypeError, r"training: expected a bool \(Python or NumPy\), got NoneType"),
    (dict(dropout_pr=float("nan")), ValueError, r"dropout_pr: expected a probability in \[0, 1\), got nan"),
    (dict(dropout_pr=-0.1), ValueError, r"dropout_pr: expected a probability in \[0, 1\), got -0.1"),
    (dict(max_seq_len=True), TypeError, r"max_seq_len: expected a non-negative int \(not a bool\), got True"),
    (dict(max_seq_len=5.0), TypeError, r"max_seq_len: expected a non-negative int, got float"),
    (dict(max_seq_len=torch.tensor(5)), TypeError, r"max_seq_len: expected a non-negative int \(not a Tensor\)"),
    (dict(max_seq_len=-1), ValueError, r"max_seq_len: expected a non-negative int, got -1"),
    (dict(max_attn_len=np.float64(2)), TypeError, r"max_attn_len: expected a non-negative int, got float64"),
    (
        dict(attn_scale=torch.ones(7)),
        ValueError,
        r"attn_scale: expected shape \(\) or one factor per query row \(8,\), got shape \(7,\)",
    ),
    (dict(attn_scale=torch.ones(8, 1)), ValueError, r"attn_scale: expected shape \(\) or one factor"),
    (
        dict(attn_scale=torch.ones(8, dtype=torch.int64)),
        TypeError,
        r"attn_scale: expected a floating dtype, got torch.int64",
    ),
    (dict(attn_scale=0.5), TypeError, r"attn_scale: expected a torch.Tensor of shape \(\) or \(total,\), got float"),
    (
        dict(attn_scale=torch.ones(8, device="meta")),
        ValueError,
        r"attn_scale.device: expected the device of q \(cpu\), got meta",
    ),
    (
        dict(attn_scale=torch.tensor(0.1), scaling_seqlen=4),
        ValueError,
        r"scaling_seqlen: expected the default -1 when attn_scale is given",
    ),
    (
        dict(kernel="fast"),
        ValueError,
        r"kernel: expected one of \['auto', 'pytorch', 'triton', 'cutlass'\], got 'fast'",
    ),
    # What the checks' fast paths (the common case read directly) must leave to the full checks, which name it.
    (
        dict(k=torch.randn(8, 2, 4).double()),
        TypeError,
        r"k.dtype: expected the dtype of q \(torch.float32\), got torch.float64",
    ),
    (
        dict(v=torch.randn(8, 2, 4).half()),
        TypeError,
        r"v.dtype: expected the dtype of q \(torch.float32\), got torch.float16",
    ),
    (dict(v=torch.randn(7, 2, 4)), ValueError, r"v.shape\[0\]: expected the rows of q \(8\), got 7"),
    (dict(q=torch.randn(8, 2)), ValueError, r"q: expected a 3-D jagged tensor \(total, H, D\), got shape \(8, 2\)"),
    (dict(q=[1.0]), TypeError, r"q: expected a torch.Tensor, got list"),
    (
        dict(num_targets=torch.tensor([1, 1], device="meta")),
        ValueError,
        r"num_targets.device: expected the device of q \(cpu\), got meta",
    ),
    (
        dict(seq_offsets=torch.tensor([0, 5, 8], device="meta")),
        ValueError,
        r"seq_offsets.device: expected the device of q \(cpu\), got meta",
    ),
    (
        dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32, device="meta")),
        ValueError,
        r"attn_func.device: expected the device of q \(cpu\), got meta",
    ),
    (dict(max_attn_len=-1), ValueError, r"max_attn_len: expected a non-negative int, got -1"),
    (dict(contextual_seq_len=True), TypeError, r"contextual_seq_len: expected a non-negative int \(not a bool\)"),
    (dict(min_full_attn_seq_len=2.0), TypeError, r"min_full_attn_seq_len: expected a non-negative int, got float"),
    (dict(dropout_pr=1.0), ValueError, r"dropout_pr: expected a probability in \[0, 1\), got 1.0"),
    (dict(dropout_pr=np.float64(1.5)), ValueError, r"dropout_pr: expected a probability in \[0, 1\), got 1.5"),
    (dict(scaling_seqlen=True), TypeError, r"scaling_seqlen: expected a real number, got bool"),
    (dict(alpha=True), TypeError, r"alpha: expected a real number, got bool"),
    (dict(alpha=np.float32("nan")), ValueError, r"alpha: expected a finite number, got nan"),
    (
        dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), causal=False),
        ValueError,
        r"attn_func: the func alone decides visibility; leave causal at the default",
    ),
    (
        dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), min_full_attn_seq_len=2),
        ValueError,
        r"leave min_full_attn_seq_len at the default",
    ),
    (dict(kernel=None), ValueError, r"kernel: expected one of \['auto', 'pytorch', 'triton', 'cutlass'\], got None"),
]


@pytest.mark.parametrize("kw,exc,msg", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_raises_a_named_error(batch, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        call(batch, **kw)


def test_cutlass_without_the_wheel_says_what_to_install(batch):
    with pytest.raises(RuntimeError, match="fbgemm"):
        call(batch, kernel=Kernel.CUTLASS)


def test_triton_on_cpu_without_the_interpreter_says_why(batch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"q.device: expected CUDA for Kernel.TRITON .*, got cpu"):
        call(batch, kernel=Kernel.TRITON)


@pytest.mark.parametrize(
    "kw,plain",
    [
        (dict(max_attn_len=np.int64(3)), dict(max_attn_len=3)),
        (dict(contextual_seq_len=np.int32(1), max_attn_len=2), dict(contextual_seq_len=1, max_attn_len=2)),
        (dict(causal=np.bool_(True)), dict(causal=True)),
        (dict(kernel="pytorch"), dict(kernel=Kernel.PYTORCH)),
        (dict(dropout_pr=np.float64(0.0)), dict(dropout_pr=0.0)),
        (dict(scaling_seqlen=np.float64(4.0), alpha=np.float32(0.5)), dict(scaling_seqlen=4.0, alpha=0.5)),
    ],
)
def test_inputs_the_fast_checks_leave_to_the_full_ones_run_as_their_plain_forms(batch, kw, plain):
    torch.testing.assert_close(call(batch, **kw), call(batch, **plain), rtol=0, atol=0)


@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint8, int])
def test_max_seq_len_accepts_any_integer_kind(batch, kind):
    torch.testing.assert_close(call(batch, max_seq_len=kind(5)), call(batch), rtol=0, atol=0)


@pytest.mark.parametrize("scaling", [0, -1, -7.5])
def test_non_positive_scaling_seqlen_means_max_seq_len(batch, scaling):
    torch.testing.assert_close(call(batch, scaling_seqlen=scaling), call(batch, scaling_seqlen=5), rtol=0, atol=0)


def test_onerank_targets_must_fill_whole_groups():
    with pytest.raises(ValueError, match=r"num_targets\[0\]: expected a multiple of group_size=4, got 3"):
        masks.onerank(offsets_from([8]), torch.tensor([3]), 4)


def compiled_call(batch, **kw):
    offs, q, k, v = batch
    args = dict(max_seq_len=5, alpha=None, q=q, k=k, v=v, seq_offsets=offs, kernel=Kernel.PYTORCH)
    args.update(kw)
    torch._dynamo.reset()
    return torch.compile(flexhstu.hstu_mha, fullgraph=True, backend="aot_eager")(**args)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(seq_offsets=torch.tensor([0, 5, 9])), r"seq_offsets\[-1\]: expected the number of rows of the data"),
        (dict(seq_offsets=torch.tensor([1, 5, 8])), r"seq_offsets\[0\]: expected 0"),
        (dict(seq_offsets=torch.tensor([0, 9, 8])), r"seq_offsets: expected non-decreasing offsets"),
        (dict(num_targets=torch.tensor([1, 4])), r"num_targets: expected 0 <= T <= the sequence length"),
        (dict(max_seq_len=4), r"max_seq_len: expected at least every sequence length"),
    ],
)
def test_offsets_that_disagree_with_the_data_raise_under_compile(batch, kw, msg):
    with pytest.raises(RuntimeError, match=msg):
        compiled_call(batch, **kw)


def test_compiled_call_with_good_offsets_equals_eager(batch):
    nt = torch.tensor([2, 1])
    torch.testing.assert_close(compiled_call(batch, num_targets=nt), call(batch, num_targets=nt, kernel=Kernel.PYTORCH))


def test_a_numpy_bool_is_a_bool_for_causal():
    # Review: the first form of the causal check refused np.True_ ("expected a bool, got bool").
    import numpy as np

    offs = torch.tensor([0, 3, 5])
    q = torch.randn(5, 1, 8)
    got = flexhstu.hstu_mha(3, None, q, q, q, offs, causal=np.True_, kernel=flexhstu.Kernel.PYTORCH)
    torch.testing.assert_close(got, flexhstu.hstu_mha(3, None, q, q, q, offs, kernel=flexhstu.Kernel.PYTORCH))
    flexhstu.build_plan(offs, total=5, max_seq_len=3, causal=np.False_)
    with pytest.raises(TypeError, match=r"causal: expected a bool \(Python or NumPy\), got str"):
        flexhstu.build_plan(offs, total=5, max_seq_len=3, causal="no")


def test_alpha_none_with_a_zero_head_dim_is_a_named_error():
    # Audit: 0 ** -0.5 raised ZeroDivisionError from inside hstu_mha.
    q = torch.randn(8, 2, 0)
    with pytest.raises(ValueError, match=r"alpha: expected a number when the head dim Dqk is 0"):
        flexhstu.hstu_mha(5, None, q, q, torch.randn(8, 2, 4), offsets_from([5, 3]))


def test_build_plan_names_num_targets_that_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"num_targets: expected None or an integer tensor of shape \(B,\), got list"):
        flexhstu.build_plan(offsets_from([5, 3]), total=8, max_seq_len=5, num_targets=[1, 1])


@pytest.mark.parametrize("huge", [2**31, 2**40, 2**64])
def test_spans_longer_than_every_sequence_all_mean_the_same(huge):
    # Audit: contextual_seq_len=2**64 gave the plain causal mask, 2**31 another one (int32 wrap-around), while
    # every value above the sequence lengths means the same rule.
    offs = offsets_from([5, 3, 0, 9])
    q, k, v = (torch.randn(17, 2, 8) for _ in range(3))
    nt = torch.tensor([1, 0, 0, 2])
    for name, other in (
        ("contextual_seq_len", {}),
        ("max_attn_len", {"contextual_seq_len": 2}),
        ("min_full_attn_seq_len", {"max_attn_len": 2}),
    ):
        small, big = ({name: x, **other, "num_targets": nt} for x in (100, huge))
        assert torch.equal(masks.fixed(offs, **small), masks.fixed(offs, **big)), name
        assert torch.equal(masks.dense_fixed(offs, 9, **small), masks.dense_fixed(offs, 9, **big)), name
        want = flexhstu.hstu_mha(9, 0.3, q, k, v, offs, kernel=Kernel.PYTORCH, **small)
        for kernel in (Kernel.PYTORCH, Kernel.TRITON):
            got = flexhstu.hstu_mha(9, 0.3, q, k, v, offs, kernel=kernel, **big)
            torch.testing.assert_close(got, want, msg=f"{name} {kernel}")


def test_dense_fixed_checks_its_arguments():
    # Audit: the public dense rule checked nothing (a bad offsets tensor gave a mask of garbage).
    offs = offsets_from([5, 3])
    for kw, exc, msg in (
        (dict(max_seq_len=4), ValueError, r"max_seq_len: expected at least every sequence length"),
        (dict(causal="no"), TypeError, r"causal: expected a bool"),
        (dict(num_targets=torch.tensor([9, 1])), ValueError, r"num_targets\[0\]: expected 0 <= T"),
        (dict(max_attn_len=-1), ValueError, r"max_attn_len: expected a non-negative int"),
    ):
        with pytest.raises(exc, match=msg):
            masks.dense_fixed(offs, **{"max_seq_len": 5, **kw})
    with pytest.raises(ValueError, match=r"seq_offsets: expected non-decreasing offsets"):
        masks.dense_fixed(torch.tensor([0, 9, 8]), 9)
