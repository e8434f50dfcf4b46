"""The STU layer body with recomputation: autograd functions that save only what is dear to rebuild.

Per layer the backward keeps ``x (total, D)``, ``uvqk (total, 2 h dh + 2 h da)`` (which the attention
keeps alive anyway: q, k and v are views of it; with ``recompute_u``, the default, v, q and k only), the
attention output ``a (total, h dh)``, the two layer norms' statistics ``(total, 1)`` and, with dropout, the
keep-mask as bool ``(total, h dh)``.
Everything else (LN(x), silu(u), LN(a), y, the concatenation ``[u, a, y]``) is pointwise in those and
is rebuilt in the backward, which costs less than writing it out in the forward and reading it back.

With ``recompute_u`` u is not kept either: the projection is two matmuls, u's columns into a buffer of
their own (which dies with the forward) and v, q, k into another, and the backward rebuilds u from the
saved x (the input norm and u's quarter of the projection again: the same calls on the same inputs, so
the same values). That is ``total * h * dh`` elements less per layer for one more ``(total, D) x (D, h
dh)`` matmul and norm in the backward.

Both functions also avoid the concatenations a plain autograd graph makes: the projection's output
is handed on as four views (so their gradients arrive separately and are never concatenated) and
the output projection's weight gradient is taken piece by piece from ``silu(u)``, ``a`` and ``y``.
Where a gradient is the sum of matmuls (``d LN(x)`` from the four pieces; ``d silu(u)`` and ``d a``,
each a pointwise term plus a matmul) the matmuls add into it in place (``addmm_``), and silu's backward
then overwrites ``d silu(u)`` with ``d u``: an out-of-place ``addmm`` of a full-size matrix first copies
that matrix into its result (cuBLAS adds into its output), which was five full-size copies a layer
and a buffer more at the backward's peak (H100 profile of the STU step, ``benchmarks/profile_stu.py``: 20
device-to-device copies, 0.9 ms of a 13 ms window step).

The rest of the forward and backward is plain functions of tensors (``Bodies``); with a ``torch.compile``
backend each is compiled on its own (no autograd inside, so the compiler fuses the pointwise work around
the matmuls but cannot change what is saved). The in-place matmuls stay outside them: compiled, an in-place
update of an intermediate is made out of place again.

Under ``torch.autocast`` the layer hands these functions its matmul weights cast to the autocast dtype and
runs them with autocast off (``STULayer.body``): their backward runs in the autocast state of the
``backward()`` call, not the forward's, and an in-place matmul casts nothing either way. The norms take their
input's dtype with the parameters' (float32) weights, the matmuls run in the weights' dtype (the casts to it
are no-ops without autocast), and the residual and its gradient keep the layer input's dtype, as in the plain
body under autocast.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F


def dropout_keep(shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """Bool keep-mask of ``shape``, each element kept with probability ``1 - p``.

    The eager and the lean layer both draw their dropout through this, so under one seed they use
    the same mask (``nn.Dropout`` draws differently on CPU and on CUDA).
    """
    return torch.rand(shape, device=device) >= p


def gate(su: torch.Tensor, an: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """``y = dropout(su * an)`` with a given keep-mask: the one formula the forward and every rebuild use."""
    y = su * an
    return y if keep is None else y * keep / (1 - p)


def norm_linear_forward(x, norm_weight, norm_bias, weight, bias, eps: float, first: int):
    """``x (total, D) -> (head, rest, mean (total, 1), rstd (total, 1))``: with ``first`` 0, ``head`` is
    ``Linear(LN(x)) (total, W)`` and ``rest`` None; else ``head`` holds its first ``first`` columns and ``rest``
    the others, from two matmuls (two buffers)."""
    xn, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], norm_weight, norm_bias, eps)
    if not first:
        return F.linear(xn.to(weight.dtype), weight, bias), None, mean, rstd
    return _linear_rows(xn, weight, bias, 0, first), _linear_rows(xn, weight, bias, first, None), mean, rstd


def _linear_rows(xn, weight, bias, lo: int, hi: int | None):
    return F.linear(xn.to(weight.dtype), weight[lo:hi], None if bias is None else bias[lo:hi])


def rebuild_head(x, norm_weight, norm_bias, weight, bias, eps: float, first: int):
    """The ``head`` of ``norm_linear_forward(..., first)``, as it made it (the same calls on the same inputs)."""
    xn = torch.native_layer_norm(x, [x.shape[-1]], norm_weight, norm_bias, eps)[0]
    return _linear_rows(xn, weight, bias, 0, first)


def norm_linear_backward(
    grads: list[torch.Tensor], x, mean, rstd, norm_weight, norm_bias, weight, eps: float, sizes: list[int], tail
):
    """Gradients of ``norm_linear_forward`` from one gradient per output piece (``sizes`` columns each); ``tail``
    is ``norm_linear_backward_tail`` (compiled or not)."""
    w_parts = torch.split(weight, sizes, dim=0)
    d_xn = grads[0] @ w_parts[0]
    for g, w in zip(grads[1:], w_parts[1:]):
        d_xn.addmm_(g, w)  # in place: accumulate, never copy (module docstring)
    return tail(d_xn, grads, x, mean, rstd, norm_weight, norm_bias, eps)


def norm_linear_backward_tail(d_xn, grads: list[torch.Tensor], x, mean, rstd, norm_weight, norm_bias, eps: float):
    """``(dx, d norm weight, d norm bias, d weight, d bias)`` from ``d LN(x)`` and the pieces' gradients."""
    d_weight = _norm_linear_weight_grad(grads, x, norm_weight, norm_bias, eps)
    d_bias = torch.cat([g.sum(0) for g in grads])
    dx, d_norm_weight, d_norm_bias = torch.ops.aten.native_layer_norm_backward(
        d_xn.to(x.dtype), x, [x.shape[-1]], mean, rstd, norm_weight, norm_bias, [True, True, True]
    )
    return dx, d_norm_weight, d_norm_bias, d_weight, d_bias


def _norm_linear_weight_grad(grads, x, norm_weight, norm_bias, eps: float):
    # Re-running the norm (one more read of x) rebuilds LN(x) bit for bit, as the forward had it; it
    # lives only for the weight gradient.
    xn = torch.native_layer_norm(x, [x.shape[-1]], norm_weight, norm_bias, eps)[0].to(grads[0].dtype)
    return torch.cat([g.t() @ xn for g in grads], dim=0)


def gated_output_forward(x, u, a, norm_weight, norm_bias, weight, bias, eps: float, keep, p: float):
    """``x + Linear([silu(u), a, gate(silu(u), LN(a))])`` and the LN(a) statistics ``(total, 1)`` twice."""
    su = F.silu(u)
    an, mean, rstd = torch.native_layer_norm(a, [a.shape[-1]], norm_weight, norm_bias, eps)
    out = x + F.linear(torch.cat([su, a, gate(su, an, keep, p)], dim=-1), weight, bias)
    return out, mean, rstd


def gated_output_backward(g, u, a, mean, rstd, norm_weight, norm_bias, weight, eps: float, keep, p: float, parts):
    """Gradients of ``gated_output_forward`` for u, a, the norm's weight and bias, and the linear's weight and bias.
    ``parts``: the ``Bodies`` that do the rest (compiled or not). The linear's gradients come first, so that
    silu(u) and y, which they read, are gone before the full-size gradients are made; the matmuls that add into
    those run here, in place (module docstring)."""
    w_u, w_a, w_y = torch.split(weight, u.shape[-1], dim=1)
    g = g.to(weight.dtype)  # autocast: the residual's gradient may be wider than the matmuls (module docstring)
    d_weight, d_bias = parts.gate_weight_grads(g, u, a, norm_weight, norm_bias, eps, keep, p)
    d_su, da, d_norm_weight, d_norm_bias = parts.gate_backward(
        g @ w_y, u, a, mean, rstd, norm_weight, norm_bias, eps, keep, p
    )
    d_su.addmm_(g, w_u)
    parts.silu_backward_(d_su, u)
    da.addmm_(g, w_a)
    return d_su, da, d_norm_weight, d_norm_bias, d_weight, d_bias


def gate_weight_grads(g, u, a, norm_weight, norm_bias, eps: float, keep, p: float):
    """The output linear's weight and bias gradients: ``g^T [silu(u), a, y]`` piece by piece, and ``g``'s column
    sums. silu(u), LN(a) and y are rebuilt here and die on return."""
    su = F.silu(u)
    an = torch.native_layer_norm(a, [u.shape[-1]], norm_weight, norm_bias, eps)[0]
    return torch.cat([g.t() @ su, g.t() @ a, g.t() @ gate(su, an, keep, p)], dim=1), g.sum(0)


def gate_backward(d_y, u, a, mean, rstd, norm_weight, norm_bias, eps: float, keep, p: float):
    """From ``d_y = g @ w_y``: (the part of d silu(u) that comes through the gate, the part of d a that comes through
    the norm, d norm weight, d norm bias). Pointwise but for the norm's row sums: LN(a) (rebuilt as the forward made
    it), silu(u) and d LN(a) are never written out when compiled."""
    if keep is not None:
        d_y = d_y * keep / (1 - p)
    an = torch.native_layer_norm(a, [u.shape[-1]], norm_weight, norm_bias, eps)[0]
    da, d_norm_weight, d_norm_bias = torch.ops.aten.native_layer_norm_backward(
        d_y * F.silu(u), a, [u.shape[-1]], mean, rstd, norm_weight, norm_bias, [True, True, True]
    )
    return d_y * an, da, d_norm_weight, d_norm_bias


def silu_backward_(d_su, u) -> None:
    """``d_su`` becomes ``d u`` (silu's backward, written over its input)."""
    torch.ops.aten.silu_backward.grad_input(d_su, u, grad_input=d_su)


class Bodies(NamedTuple):
    """The pieces of the two functions that run compiled or not: everything but the matmuls that add into a
    full-size gradient (``norm_linear_backward`` and ``gated_output_backward`` run those in place around them)."""

    norm_linear_forward: object
    norm_linear_backward_tail: object
    gated_output_forward: object
    gate_weight_grads: object
    gate_backward: object
    silu_backward_: object
    rebuild_head: object


EAGER = Bodies(
    norm_linear_forward,
    norm_linear_backward_tail,
    gated_output_forward,
    gate_weight_grads,
    gate_backward,
    silu_backward_,
    rebuild_head,
)


@functools.cache
def compiled_bodies(backend: str) -> Bodies:
    """The bodies under ``torch.compile(backend=backend)``, compiled once per process and backend."""
    return Bodies(*(torch.compile(f, backend=backend) for f in EAGER))


class NormLinear(torch.autograd.Function):
    """``x (total, D) -> split(Linear(LN(x)), sizes)``: saves x and the LN statistics, not LN(x).

    Returns one view per entry of ``sizes`` into a single ``(total, sum(sizes))`` buffer; with ``own_first`` the
    first piece has a buffer of its own (``recompute_u``: it can die while the others live).
    """

    @staticmethod
    def forward(
        ctx,
        x,
        norm_weight,
        norm_bias,
        weight,
        bias,
        eps: float,
        sizes: list[int],
        bodies: Bodies,
        own_first: bool = False,
    ):
        head, rest, mean, rstd = bodies.norm_linear_forward(
            x, norm_weight, norm_bias, weight, bias, eps, sizes[0] if own_first else 0
        )
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.eps, ctx.sizes, ctx.bodies = eps, sizes, bodies
        if own_first:
            return head, *torch.split(rest, sizes[1:], dim=-1)
        return tuple(torch.split(head, sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        # Pieces with no gradient arrive as zeros (autograd materialises them for Functions by default).
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        return (
            *norm_linear_backward(
                list(grads),
                x,
                mean,
                rstd,
                norm_weight,
                norm_bias,
                weight,
                ctx.eps,
                ctx.sizes,
                ctx.bodies.norm_linear_backward_tail,
            ),
            None,
            None,
            None,
            None,
        )


class GatedOutput(torch.autograd.Function):
    """``x + Linear([silu(u), a, gate(silu(u), LN(a), keep)])`` for ``x (total, D)``, ``u, a (total, n)``.

    Saves u, a, the LN(a) statistics and the keep-mask (``None`` without dropout); rebuilds the rest. With
    ``rebuild_u`` (the input norm's weight, bias and eps and the input projection's weight and bias, u being the
    first ``n`` columns of ``NormLinear`` of ``x``) it saves x instead of u and rebuilds u in the backward.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        u,
        a,
        norm_weight,
        norm_bias,
        weight,
        bias,
        eps: float,
        keep,
        p: float,
        bodies: Bodies,
        rebuild_u: tuple | None = None,
    ):
        out, mean, rstd = bodies.gated_output_forward(x, u, a, norm_weight, norm_bias, weight, bias, eps, keep, p)
        if rebuild_u is None:
            ctx.save_for_backward(u, a, mean, rstd, norm_weight, norm_bias, weight, keep)
        else:
            in_norm_weight, in_norm_bias, in_eps, w_in, b_in = rebuild_u
            ctx.save_for_backward(
                x, a, mean, rstd, norm_weight, norm_bias, weight, keep, in_norm_weight, in_norm_bias, w_in, b_in
            )
            ctx.in_eps = in_eps
        ctx.rebuild, ctx.eps, ctx.p, ctx.bodies = rebuild_u is not None, eps, p, bodies
        return out

    @staticmethod
    def backward(ctx, g):
        u, a, mean, rstd, norm_weight, norm_bias, weight, keep, *inputs = ctx.saved_tensors
        if ctx.rebuild:  # u is the first a.shape[-1] columns of the layer input's projection
            u = ctx.bodies.rebuild_head(u, inputs[0], inputs[1], inputs[2], inputs[3], ctx.in_eps, a.shape[-1])
        grads = gated_output_backward(
            g, u, a, mean, rstd, norm_weight, norm_bias, weight, ctx.eps, keep, ctx.p, ctx.bodies
        )
        return g, *grads, None, None, None, None, None
