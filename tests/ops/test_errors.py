"""Bad input gets a clear error naming the argument, what was expected and what was given."""

from __future__ import annotations

import pytest
import torch

import flexhstu
from flexhstu import Kernel, masks
from rules import offsets_from


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
    (dict(attn_func=torch.zeros(1, 1, 8, dtype=torch.int64)), TypeError, r"attn_func: expected dtype torch.int32, got torch.int64"),
    (dict(attn_func=torch.zeros(1, 8, dtype=torch.int32)), ValueError, r"attn_func: expected a 3-D tensor"),
    (dict(attn_func=torch.zeros(1, 4, 8, dtype=torch.int32)), ValueError, r"attn_func.shape\[1\] \(NFUNC\): expected an odd width >= 1, got 4"),
    (dict(attn_func=torch.zeros(1, 3, 7, dtype=torch.int32)), ValueError, r"attn_func.shape\[2\]: expected one column per query row \(8\), got 7"),
    (dict(attn_func=torch.zeros(3, 3, 8, dtype=torch.int32)), ValueError, r"attn_func.shape\[0\] \(Hf\): expected 1 or the number of heads \(2\), got 3"),
    (dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), num_targets=torch.tensor([1, 1])), ValueError, r"attn_func: .*leave num_targets at the default"),
    (dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), max_attn_len=3), ValueError, r"leave max_attn_len"),
    (dict(attn_func=torch.zeros(1, 3, 8, dtype=torch.int32), contextual_seq_len=1), ValueError, r"leave contextual_seq_len"),
    (dict(k=torch.randn(7, 2, 4)), ValueError, r"k.shape\[0\]: expected the rows of q \(8\), got 7"),
    (dict(v=torch.randn(8, 3, 4)), ValueError, r"v.shape\[1\] \(heads\): expected the heads of q \(2\), got 3"),
    (dict(k=torch.randn(8, 2, 6)), ValueError, r"k.shape\[2\] \(Dqk\): expected the head dim of q \(4\), got 6"),
    (dict(seq_offsets=torch.tensor([1, 5, 8])), ValueError, r"seq_offsets\[0\]: expected 0, got 1"),
    (dict(seq_offsets=torch.tensor([0, 6, 5, 8])), ValueError, r"seq_offsets: expected non-decreasing offsets, got seq_offsets\[2\] = 5 < seq_offsets\[1\] = 6"),
    (dict(seq_offsets=torch.tensor([0, 5, 9])), ValueError, r"seq_offsets\[-1\]: expected the number of rows of the data \(8\), got 9"),
    (dict(seq_offsets=torch.tensor([0, 5, 8.0])), TypeError, r"seq_offsets: expected dtype torch.int32 or torch.int64"),
    (dict(max_seq_len=4), ValueError, r"max_seq_len: expected at least every sequence length \(sequence 0 has 5\), got 4"),
    (dict(num_targets=torch.tensor([1, 4])), ValueError, r"num_targets\[1\]: expected 0 <= T <= the sequence length 3, got 4"),
    (dict(num_targets=torch.tensor([1])), ValueError, r"num_targets: expected a \(2,\) tensor"),
    (dict(dropout_pr=1.5), ValueError, r"dropout_pr: expected a probability in \[0, 1\), got 1.5"),
    (dict(q=torch.randn(8, 2, 4).long()), TypeError, r"q: expected float16, bfloat16, float32 or float64"),
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
    with pytest.raises(RuntimeError, match="Kernel.TRITON runs on CUDA tensors"):
        call(batch, kernel=Kernel.TRITON)


def test_triton_rejects_dropout(batch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="dropout_pr: Kernel.TRITON has no dropout"):
        call(batch, kernel=Kernel.TRITON, dropout_pr=0.1)


def test_onerank_targets_must_fill_whole_groups():
    with pytest.raises(ValueError, match=r"num_targets\[0\]: expected a multiple of group_size=4, got 3"):
        masks.onerank(offsets_from([8]), torch.tensor([3]), 4)
