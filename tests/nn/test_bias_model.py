"""The relative attention bias in the model: STU layers, HSTU retrieval, and the train flag through resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rules import offsets_from
from tiny_run import TINY as TINY_RUN

from flexhstu import checkpoint, train
from flexhstu.cli.common import UserError
from flexhstu.models import HSTURetrieval, make_batch
from flexhstu.nn import STULayerConfig, STUStack

LENGTHS = [9, 0, 13, 4]
DIM, HEADS = 16, 2
TINY = [*TINY_RUN, "--epochs", "2"]


def _stack(recompute: bool, rel_bias: bool = True) -> STUStack:
    torch.manual_seed(0)
    cfg = STULayerConfig(
        embedding_dim=DIM,
        num_heads=HEADS,
        attention_dim=8,
        hidden_dim=8,
        dropout=0.0,
        recompute=recompute,
        compile=False,
        rel_bias=rel_bias,
        rel_bias_max_len=16,
        rel_bias_buckets=32,
    )
    return STUStack(cfg, 2)


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(LENGTHS), DIM, generator=g, requires_grad=True)
    ts = torch.cumsum(torch.randint(0, 5000, (sum(LENGTHS),), generator=g), 0)
    return x, offsets_from(LENGTHS), ts


def test_every_layer_owns_a_bias_and_its_tables_get_gradients_in_the_lean_and_plain_bodies():
    x, offs, ts = _inputs()
    outs = {}
    for recompute in (True, False):
        stack = _stack(recompute)
        out = stack(x, offs, max(LENGTHS), ts)
        # A fixed weighting, not out.square(): the sum of squares of a LayerNorm's output is nearly constant, so its
        # gradients are mostly cancellation and differ between bodies that round differently.
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        grads = torch.autograd.grad(
            (out * weights).sum(),
            [layer.rel_bias.ts_w for layer in stack.layers] + [layer.rel_bias.pos_w for layer in stack.layers],
        )
        assert all(g.abs().sum() > 0 for g in grads)
        outs[recompute] = out, grads
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[True][1], outs[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert len({id(layer.rel_bias) for layer in _stack(True).layers}) == 2  # one per layer, as published


def test_zero_tables_give_the_output_of_a_layer_without_bias():
    x, offs, ts = _inputs()
    biased, plain = _stack(True), _stack(True, rel_bias=False)
    missing = plain.load_state_dict(biased.state_dict(), strict=False).unexpected_keys
    assert sorted(missing) == [f"layers.{i}.rel_bias.{w}" for i in (0, 1) for w in ("pos_w", "ts_w")]
    want = plain(x, offs, max(LENGTHS))
    assert not torch.allclose(biased(x, offs, max(LENGTHS), ts), want)
    with torch.no_grad():
        for layer in biased.layers:
            layer.rel_bias.pos_w.zero_(), layer.rel_bias.ts_w.zero_()
    torch.testing.assert_close(biased(x, offs, max(LENGTHS), ts), want, rtol=0, atol=0)


def test_a_biased_layer_without_timestamps_is_an_error():
    x, offs, _ = _inputs()
    with pytest.raises(ValueError, match=r"timestamps: expected the \(total,\) event times .*got None"):
        _stack(True)(x, offs, max(LENGTHS))


def test_config_refuses_a_bias_without_a_position_table():
    with pytest.raises(ValueError, match=r"rel_bias_max_len: expected a positive int .*got 0"):
        STULayerConfig(rel_bias=True)


def test_config_takes_numpy_integers_and_refuses_floats():
    cfg = STULayerConfig(rel_bias=True, rel_bias_max_len=np.int64(8), rel_bias_buckets=np.int32(4))
    assert cfg.rel_bias_max_len == 8 and cfg.rel_bias_buckets == 4
    with pytest.raises(ValueError, match=r"rel_bias_max_len: expected a positive int .*got 8.0"):
        STULayerConfig(rel_bias=True, rel_bias_max_len=8.0)


def test_timestamps_of_another_length_than_the_items_are_an_error_naming_them():
    from flexhstu.nn import InputEncoder

    enc = InputEncoder(10, 8, 16)
    offs = offsets_from([3, 4])
    with pytest.raises(ValueError, match=r"timestamps: expected one time per item, shape \(7,\), got shape \(6,\)"):
        enc(torch.arange(1, 8), torch.arange(6), offs)


@pytest.mark.parametrize("rel_bias", [True, False])
def test_hstu_retrieval_trains_with_and_without_the_bias(rel_bias):
    rng = np.random.default_rng(0)
    # Planted structure: each next item is the current one + 1, so a few steps lower the loss.
    items = [np.arange(s, s + n) % 40 + 1 for s, n in zip(rng.integers(0, 40, 32), rng.integers(3, 15, 32))]
    times = [np.cumsum(rng.integers(1, 10**5, len(s))) for s in items]
    batch = make_batch(items, times, max_len=14)
    torch.manual_seed(0)
    model = HSTURetrieval(40, dim=16, layers=2, heads=2, max_len=14, dropout=0.0, rel_bias=rel_bias)
    assert all((layer.rel_bias is not None) == rel_bias for layer in model.stack.layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(8):
        loss = model(batch, 16, gen)
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_no_rel_bias_is_recorded_and_fixed_on_resume(tmp_path):
    out = tmp_path / "run"
    train.main(TINY + ["--no-rel-bias", "--stop-after", "1", "--out", str(out)])
    state = checkpoint.load(out / "checkpoint.pt", map_location="cpu")
    assert state["config"]["no_rel_bias"] is True
    assert not any("rel_bias" in key for key in state["model"])
    with pytest.raises(UserError, match=r"--no-rel-bias True in the checkpoint, False now"):
        train.main(TINY + ["--resume", "--out", str(out)])
    resumed = train.main(TINY + ["--no-rel-bias", "--resume", "--out", str(out)])
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]


def test_the_default_run_has_the_bias_in_its_checkpoint(tmp_path):
    train.main(TINY + ["--stop-after", "1", "--out", str(tmp_path)])
    state = checkpoint.load(tmp_path / "checkpoint.pt", map_location="cpu")
    assert state["config"]["no_rel_bias"] is False
    assert {"stack.layers.0.rel_bias.pos_w", "stack.layers.0.rel_bias.ts_w"} <= set(state["model"])
    assert state["model"]["stack.layers.0.rel_bias.pos_w"].shape == (2 * 20 - 1,)
