"""STU layer bodies: lean (recompute) and compiled against the plain autograd layer; what the lean body saves."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
from rules import offsets_from
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from flexhstu import Kernel, build_plan, masks
from flexhstu.nn import STULayer, STULayerConfig, STUStack
from flexhstu.nn.stu_lean import dropout_keep, gate

LENGTHS = [21, 0, 34, 9]
DIM, HEADS, DQK, DV = 32, 2, 8, 16
interpreting = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton kernel on CPU"
)


def _stack(dropout: float, num_layers: int = 2, **kw) -> STUStack:
    torch.manual_seed(0)
    cfg = STULayerConfig(embedding_dim=DIM, num_heads=HEADS, attention_dim=DQK, hidden_dim=DV, dropout=dropout, **kw)
    return STUStack(cfg, num_layers)


def _step(stack: STUStack, seed: int = 7, **mask_kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of (x, every parameter) for a loss that weights each output element."""
    offs = offsets_from(LENGTHS)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(LENGTHS), DIM, generator=gen, requires_grad=True)
    torch.manual_seed(seed)  # the dropout draws
    out = stack(x, offs, max(LENGTHS), **mask_kwargs)
    weights = torch.randn(out.shape, generator=gen)
    return out, list(torch.autograd.grad((out * weights).sum(), [x, *stack.parameters()]))


def _assert_same_step(got, want, rtol=1e-5):
    """Output and every gradient within ``rtol`` of the reference, relative to the tensor's largest element
    (elementwise relative error means nothing for an element that is a sum cancelling to about 0)."""
    assert len(got[1]) == len(want[1])
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * float(w.abs().max()))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lean_layer_gives_the_plain_output_and_gradients(dropout):
    # u kept (u rebuilt: the next test; its projection is two matmuls, so its forward is equal to rounding only)
    plain = _step(_stack(dropout, recompute=False, compile=False))
    lean = _step(_stack(dropout, recompute=True, recompute_u=False, compile=False))
    assert torch.equal(lean[0], plain[0])  # the same forward ops, in the same order
    _assert_same_step(lean, plain)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lean_layer_rebuilding_u_gives_the_plain_output_and_gradients(dropout, compile):
    # u from its own matmul (its quarter of the projection) and rebuilt in the backward: the plain layer's
    # values to float32 rounding.
    plain = _step(_stack(dropout, recompute=False, compile=False))
    kw = dict(compile=True, compile_backend="aot_eager") if compile else dict(compile=False)
    lean = _step(_stack(dropout, recompute=True, recompute_u=True, **kw))
    _assert_same_step(lean, plain)


class _OutOfPlaceAddmm(TorchDispatchMode):
    """Records the shape of the matrix every out-of-place ``addmm`` adds into (a 1-D bias is not a matrix)."""

    def __init__(self):
        super().__init__()
        self.added_into: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default and args[0].dim() == 2:
            self.added_into.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute_u", [False, True])
def test_lean_backward_adds_matmuls_into_its_gradients_in_place(recompute_u):
    # An out-of-place addmm into a full-size matrix copies that matrix first (five (total, h dh) copies a layer on
    # the GPU before the bodies added in place); the forward's biases are vectors, so no addmm of a matrix remains.
    stack = _stack(0.2, recompute=True, recompute_u=recompute_u, compile=False)
    with _OutOfPlaceAddmm() as mode:
        _, grads = _step(stack)
    assert mode.added_into == [] and all(torch.isfinite(g).all() for g in grads)


def test_dropout_draws_differ_between_seeds():
    # Guards the dropout tests above: with another seed the mask, hence the output, must change.
    stack = _stack(0.3, recompute=True, compile=False)
    assert not torch.allclose(_step(stack, seed=7)[0], _step(stack, seed=8)[0])


@pytest.mark.parametrize(
    ("recompute", "recompute_u", "backend"),
    [
        (False, None, "aot_eager"),
        (True, False, "aot_eager"),
        (True, True, "aot_eager"),
        (True, False, "inductor"),
        (True, True, "inductor"),
    ],
)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_compiled_layer_gives_the_plain_output_and_gradients(recompute, recompute_u, backend, dropout):
    # inductor, as on the GPU: the lean bodies' generated code, silu's backward written over its input included.
    func = masks.sla(offsets_from(LENGTHS), 8, 2)
    plain = _step(_stack(dropout, recompute=False, compile=False), attn_func=func)
    stack = _stack(dropout, recompute=recompute, recompute_u=recompute_u, compile=True, compile_backend=backend)
    _assert_same_step(_step(stack, attn_func=func), plain)


def test_a_compiled_stack_runs_a_replaced_or_hooked_final_norm_as_set():
    # With the layers compiled, the final LayerNorm runs as a compiled function; a norm the user replaced or hooked
    # must still run as the user set it.
    offs, x = offsets_from(LENGTHS), torch.randn(sum(LENGTHS), DIM)
    stack = _stack(0.0, num_layers=1, compile=True, compile_backend="aot_eager")
    seen = []
    handle = stack.norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    stack(x, offs, 64)
    handle.remove()
    assert seen == [x.shape]
    eager = _stack(0.0, num_layers=1, compile=False)
    for s in (stack, eager):
        s.norm = torch.nn.RMSNorm(DIM)
    torch.testing.assert_close(stack(x, offs, 64), eager(x, offs, 64))


def test_dropout_keeps_elements_with_probability_one_minus_p():
    torch.manual_seed(0)
    keep = dropout_keep((400, 500), 0.3, torch.device("cpu"))
    assert keep.dtype == torch.bool
    assert abs(keep.float().mean().item() - 0.7) < 0.005  # 7 standard deviations of the mean of 2e5 draws
    y = gate(torch.ones(400, 500), torch.ones(400, 500), keep, 0.3)
    torch.testing.assert_close(y.unique(), torch.tensor([0.0, 1 / 0.7]))  # kept elements scaled to keep the mean


def test_eval_mode_has_no_dropout():
    stack = _stack(0.5, recompute=True, compile=False).eval()
    plain = _stack(0.0, recompute=False, compile=False)
    _assert_same_step(_step(stack, seed=1), _step(plain, seed=2))


def test_default_compiles_for_cuda_inputs_only():
    layer = STULayer(STULayerConfig())
    assert not layer.compiles(torch.zeros(3, 64))
    with FakeTensorMode():
        assert layer.compiles(torch.zeros(3, 64, device="cuda"))
    assert not STULayer(STULayerConfig(compile=False)).compiles(torch.zeros(3, 64))
    assert STULayer(STULayerConfig(compile=True)).compiles(torch.zeros(3, 64))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("dropout", 1.0, "dropout: expected a probability in [0, 1), got 1.0"),
        ("embedding_dim", 0, "embedding_dim: expected a positive int, got 0"),
        ("recompute", "yes", "recompute: expected a bool, got str"),
        ("recompute_u", 1, "recompute_u: expected None (as recompute) or a bool, got int"),
        ("compile", "auto", "compile: expected None (compile on CUDA only) or a bool, got str"),
        # Checked when the config is made: a string passes float() and breaks the first forward, an unknown kernel too.
        ("dropout", "0.1", "dropout: expected a real number, got str"),
        ("kernel", "bogus", "kernel: expected one of ['auto', 'pytorch', 'triton', 'cutlass'], got 'bogus'"),
    ],
)
def test_bad_config_names_the_field(field, value, words):
    with pytest.raises((ValueError, TypeError)) as err:
        STULayerConfig(**{field: value})
    assert str(err.value) == words


def test_recompute_u_without_the_lean_body_is_named():
    with pytest.raises(ValueError) as err:
        STULayerConfig(recompute=False, recompute_u=True)
    assert str(err.value) == "recompute_u: expected False without recompute (only the lean body rebuilds u), got True"


def test_u_is_rebuilt_by_default_with_the_lean_body_only():
    assert STULayerConfig().rebuilds_u and STULayerConfig(recompute=True).rebuilds_u
    assert not STULayerConfig(recompute=False).rebuilds_u
    assert not STULayerConfig(recompute_u=False).rebuilds_u
    # A config derived from a default one without the lean body is valid (the default is not stored as True).
    assert not dataclasses.replace(STULayerConfig(), recompute=False).rebuilds_u


@pytest.mark.parametrize(
    "x, err, words",
    [
        (
            torch.zeros(64, DIM // 2),
            ValueError,
            "x: expected a (total, 32) tensor (embedding_dim=32), got shape (64, 16)",
        ),
        (
            torch.zeros(64, 1, DIM),
            ValueError,
            "x: expected a (total, 32) tensor (embedding_dim=32), got shape (64, 1, 32)",
        ),
        (
            torch.zeros(64, DIM, dtype=torch.float64),
            TypeError,
            "x: expected torch.float32 (the layer's parameters; or run under torch.autocast), got torch.float64",
        ),
        (
            torch.zeros(64, DIM, dtype=torch.int64),
            TypeError,
            "x: expected a floating tensor (torch.float32, the layer's parameters), got torch.int64",
        ),
        ([0.0] * 64, TypeError, "x: expected a (total, 32) tensor, got list"),
    ],
)
def test_bad_rows_name_x_in_the_layer_and_the_stack(x, err, words):
    stack, offs = _stack(0.0, num_layers=1), offsets_from(LENGTHS)
    for call in (lambda: stack(x, offs, 64), lambda: stack.layers[0](x, offs, 64)):
        with pytest.raises(err) as e:
            call()
        assert str(e.value) == words


def test_a_stack_without_layers_and_bf16_layers_with_float32_norms_still_run():
    # Review: the checks must not refuse these (a zero-layer stack is the final norm; mixed-precision setups keep
    # norms in float32, and FSDP casts each layer's parameters only when that layer runs).
    offs, x = offsets_from(LENGTHS), torch.randn(sum(LENGTHS), DIM)
    torch.testing.assert_close(_stack(0.0, num_layers=0)(x, offs, 64), torch.nn.functional.layer_norm(x, (DIM,)))
    stack = _stack(0.0, num_layers=2).bfloat16()
    for layer in stack.layers:
        layer.norm.float()
    assert stack(x.bfloat16(), offs, 64).dtype == torch.bfloat16


@pytest.mark.parametrize("float32_norms", [False, True])
@pytest.mark.parametrize("compile", [False, True])
def test_lean_layer_in_bf16_gives_the_plain_gradients(compile, float32_norms):
    # The lean backward mixes bf16 rows with float32 norm statistics (a float32 intermediate there meets a bf16
    # matmul and fails): it must run and equal the plain body's gradients to bf16 rounding.
    kw = dict(compile=True, compile_backend="aot_eager") if compile else dict(compile=False)
    steps = []
    for lean in (False, True):
        stack = _stack(0.2, recompute=lean, recompute_u=lean, **(kw if lean else dict(compile=False))).bfloat16()
        if float32_norms:
            for layer in stack.layers:
                layer.norm.float()
                layer.attn_norm.float()
        offs = offsets_from(LENGTHS)
        x = torch.randn(sum(LENGTHS), DIM, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
        torch.manual_seed(7)
        out = stack(x, offs, max(LENGTHS))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))  # not out.square(): a norm's
        grads = torch.autograd.grad((out.float() * weights).sum(), [x, *stack.parameters()])  # is ~constant
        steps.append((out, [g.float() for g in grads]))
    _assert_same_step((steps[1][0].float(), steps[1][1]), (steps[0][0].float(), steps[0][1]), rtol=3e-2)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lean", ["u kept", "u rebuilt"])
def test_lean_layer_trains_under_autocast_as_the_plain_one(lean, x_dtype):
    """float32 parameters under bf16 autocast, rows in float32 or bf16: the lean backward (which runs outside
    autocast) gives the plain body's output and gradients to bf16 rounding, each in its tensor's dtype."""
    steps = []
    for kw in [dict(recompute=False), dict(recompute=True, recompute_u=lean == "u rebuilt")]:
        stack, offs = _stack(0.3, compile=False, **kw), offsets_from(LENGTHS)
        x = torch.randn(sum(LENGTHS), DIM, generator=torch.Generator().manual_seed(1)).to(x_dtype).requires_grad_()
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = stack(x, offs, max(LENGTHS))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        grads = torch.autograd.grad((out.float() * weights).sum(), [x, *stack.parameters()])
        assert [g.dtype for g in grads] == [x_dtype] + [torch.float32] * (len(grads) - 1)
        steps.append((out.detach().float(), [g.float() for g in grads]))
    _assert_same_step(steps[1], steps[0], rtol=3e-2)


def test_a_float64_model_stays_float64_under_autocast():
    """autocast casts no float64 tensor, so neither may the lean layer: the plain body's output, exactly."""
    outs = []
    for recompute in (False, True):
        stack, offs = _stack(0.0, num_layers=1, recompute=recompute, compile=False), offsets_from(LENGTHS)
        stack.double()
        x = torch.randn(sum(LENGTHS), DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(stack(x, offs, max(LENGTHS)))
    assert outs[1].dtype == torch.float64
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


def activation_bytes(fn, params) -> int:
    """Bytes the autograd graph of ``fn()`` saves, counted once per storage, parameters left out."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def lean_saved_bytes(total: int, cfg: STULayerConfig, itemsize: int, nseq: int) -> int:
    """What one lean layer should save: x, uvqk (vqk with recompute_u), a; two norms' (mean, rstd) in fp32; the
    dropout keep-mask (bool); the attention's int64 offsets."""
    h, da, dh, d = cfg.num_heads, cfg.attention_dim, cfg.hidden_dim, cfg.embedding_dim
    x, uvqk, a = total * d, total * h * ((1 if cfg.rebuilds_u else 2) * dh + 2 * da), total * h * dh
    stats = 2 * 2 * total * 4
    keep = total * h * dh if cfg.dropout > 0 else 0
    return (x + uvqk + a) * itemsize + stats + keep + (nseq + 1) * 8


@interpreting
@pytest.mark.parametrize("recompute_u", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("compile", [False, True])
def test_lean_layer_saves_x_uvqk_and_attention_output_only(dropout, compile, recompute_u):
    # The Triton kernel saves q, k, v as given (views of uvqk); the reference would add its padded copies.
    lengths = [40, 24]
    offs = offsets_from(lengths)
    x = torch.randn(sum(lengths), DIM, requires_grad=True)
    saved = {}
    for recompute in (False, True):
        cfg = STULayerConfig(
            embedding_dim=DIM,
            num_heads=HEADS,
            attention_dim=DQK,
            hidden_dim=DV,
            dropout=dropout,
            kernel=Kernel.TRITON,
            recompute=recompute,
            recompute_u=recompute_u and recompute,
            compile=compile,
            compile_backend="aot_eager",
        )
        layer = STULayer(cfg)
        saved[recompute] = activation_bytes(functools.partial(layer, x, offs, max(lengths)), list(layer.parameters()))
    assert saved[True] == lean_saved_bytes(x.shape[0], cfg, x.element_size(), len(lengths))
    assert saved[True] < 0.55 * saved[False]


@interpreting
def test_lean_layer_on_the_triton_kernel_gives_the_plain_reference_layer():
    func = masks.sla(offsets_from(LENGTHS), 8, 2)
    plain = _step(_stack(0.0, num_layers=1, kernel=Kernel.PYTORCH, recompute=False, compile=False), attn_func=func)
    lean = _step(_stack(0.0, num_layers=1, kernel=Kernel.TRITON, recompute=True, compile=False), attn_func=func)
    _assert_same_step(lean, plain, rtol=1e-4)


@pytest.mark.parametrize(
    "num_layers, err, words",
    [
        (-3, ValueError, "num_layers: expected a non-negative int, got -3"),  # not a stack of the norm alone
        (2.0, TypeError, "num_layers: expected a non-negative int, got float"),
    ],
)
def test_a_layer_count_that_is_not_a_count_is_named(num_layers, err, words):
    with pytest.raises(err) as e:
        STUStack(STULayerConfig(embedding_dim=DIM), num_layers)
    assert str(e.value) == words


def test_the_stack_names_an_unknown_mask_argument_and_sparse_next_to_a_plan():
    # Named by the stack: rab= would otherwise raise build_plan's "unexpected keyword argument" (a function the
    # caller never called), and sparse= next to attn_plan= would be ignored without a word.
    stack, offs = _stack(0.0, num_layers=1), offsets_from(LENGTHS)
    x = torch.randn(sum(LENGTHS), DIM)
    with pytest.raises(TypeError, match=r"^rab: expected one of STUStack.forward's mask arguments \['attn_func', "):
        stack(x, offs, 64, rab=torch.zeros(1))
    plan = build_plan(offs, total=x.shape[0], max_seq_len=64)
    with pytest.raises(ValueError, match=r"^sparse: expected None when attn_plan is given"):
        stack(x, offs, 64, attn_plan=plan, sparse=True)
    torch.testing.assert_close(stack(x, offs, 64, attn_plan=plan), stack(x, offs, 64))
