"""The STU layer (HSTU's sequential transduction unit) and a stack of them sharing one mask."""

from __future__ import annotations

import contextlib
import functools
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import as_finite, as_int, bad_type, bad_value
from ..ops import AttnPlan, Kernel, build_plan, hstu_mha
from .learned_bias import RelativeTimePositionBias
from .stu_lean import EAGER, GatedOutput, NormLinear, compiled_bodies, dropout_keep, gate


@dataclass(kw_only=True)
class STULayerConfig:
    """Sizes and execution of an STU layer. Keyword-only: the generative-recommenders config orders its
    fields differently (``hidden_dim`` before ``attention_dim``), so a positional call could swap them.

    ``recompute``: the lean body (``flexhstu.nn.stu_lean``), which saves x, v, q, k (uvqk when u is kept), the
    attention output and the norm statistics and rebuilds the rest in the backward; forward and gradients equal to
    the plain body's to rounding (the same forward ops when u is kept). ``recompute_u`` (with ``recompute``;
    ``None``, the default, follows ``recompute``): the lean body keeps the layer input rather than ``u`` and
    rebuilds u in the backward (one more norm and quarter of the projection): ``total * num_heads * hidden_dim``
    elements less held per layer for 2-4% more step time (H100, B16 S4096, 4 layers of 512: peak 2.10 -> 1.86
    GiB; benchmarks/RESULTS.md). ``compile``: fuse the body's memory-bound steps with
    ``torch.compile(backend=compile_backend)``: with ``recompute`` the lean functions' forward and backward bodies
    are compiled (what is saved stays as designed), without it the whole plain body is. ``None`` (the default)
    compiles for CUDA inputs only: on the CPU, compiling costs more than it saves for the small models trained
    there. The attention is ``hstu_mha`` in every case.

    ``rel_bias``: the layer owns a relative attention bias (``flexhstu.nn.RelativeTimePositionBias``,
    the published HSTU's: one per layer, shared by the heads) over ``rel_bias_max_len`` positions and
    ``rel_bias_buckets`` time-gap buckets, and its forward needs the event times.
    """

    embedding_dim: int = 64
    num_heads: int = 2
    attention_dim: int = 32  # per head, for q and k
    hidden_dim: int = 32  # per head, for u and v
    dropout: float = 0.1
    kernel: Kernel = Kernel.AUTO
    recompute: bool = True
    recompute_u: bool | None = None  # None: as recompute
    compile: bool | None = None
    compile_backend: str = "inductor"
    rel_bias: bool = False
    rel_bias_max_len: int = 0  # the position table covers relative positions up to +-(rel_bias_max_len - 1)
    rel_bias_buckets: int = 128

    @property
    def rebuilds_u(self) -> bool:
        """Whether the lean body rebuilds u in the backward: ``recompute_u``, or ``recompute`` when it is None."""
        return self.recompute if self.recompute_u is None else self.recompute_u

    def __post_init__(self):
        for name in ("embedding_dim", "num_heads", "attention_dim", "hidden_dim"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise bad_value(name, "a positive int", val)
        self.dropout = as_finite("dropout", self.dropout)  # a string passed float() here, then broke forward
        if not 0.0 <= self.dropout < 1.0:
            raise bad_value("dropout", "a probability in [0, 1)", self.dropout)
        try:
            self.kernel = Kernel(self.kernel)
        except ValueError:
            raise bad_value("kernel", f"one of {[k.value for k in Kernel]}", repr(self.kernel)) from None
        if not isinstance(self.recompute, bool):
            raise bad_type("recompute", "a bool", type(self.recompute).__name__)
        # None stays None (resolved by rebuilds_u): replace(cfg, recompute=False) of a default config must not
        # carry a resolved True into a config without the lean body.
        if self.recompute_u is not None and not isinstance(self.recompute_u, bool):
            raise bad_type("recompute_u", "None (as recompute) or a bool", type(self.recompute_u).__name__)
        if self.recompute_u and not self.recompute:
            raise bad_value("recompute_u", "False without recompute (only the lean body rebuilds u)", True)
        if self.compile is not None and not isinstance(self.compile, bool):
            raise bad_type("compile", "None (compile on CUDA only) or a bool", type(self.compile).__name__)
        if not isinstance(self.compile_backend, str):
            raise bad_type("compile_backend", "a torch.compile backend name", type(self.compile_backend).__name__)
        if not isinstance(self.rel_bias, bool):
            raise bad_type("rel_bias", "a bool", type(self.rel_bias).__name__)
        if self.rel_bias and (not _is_int(self.rel_bias_max_len) or self.rel_bias_max_len < 1):
            raise bad_value(
                "rel_bias_max_len", "a positive int (the longest sequence) with rel_bias", self.rel_bias_max_len
            )
        if not _is_int(self.rel_bias_buckets) or self.rel_bias_buckets < 0:
            raise bad_value("rel_bias_buckets", "a non-negative int", self.rel_bias_buckets)


def check_rows(
    x: object,
    dim: int,
    dtypes: tuple[torch.dtype, ...] = (),
    device: torch.device | None = None,
    autocast_ok: bool = True,
    arg: str = "x",
) -> None:
    """``x`` must be a ``(total, dim)`` tensor; with ``dtypes``, floating and of one of them (any floating dtype
    under autocast when ``autocast_ok``, autocast casting inside); with ``device``, on it. A clear error here,
    not a shape or dtype error deep in a norm or a matmul (metadata only, no device read)."""
    if not isinstance(x, torch.Tensor):
        raise bad_type(arg, f"a (total, {dim}) tensor", type(x).__name__)
    if x.dim() != 2 or x.shape[1] != dim:
        raise bad_value(arg, f"a (total, {dim}) tensor (embedding_dim={dim})", f"shape {tuple(x.shape)}")
    if dtypes:
        names = " or ".join(dict.fromkeys(map(str, dtypes)))
        if not x.is_floating_point():
            raise bad_type(arg, f"a floating tensor ({names}, the layer's parameters)", x.dtype)
        autocast = autocast_ok and torch.is_autocast_enabled(x.device.type)
        if x.dtype not in dtypes and not autocast:
            hint = "; or run under torch.autocast" if autocast_ok else ""
            raise bad_type(arg, f"{names} (the layer's parameters{hint})", x.dtype)
    if device is not None and x.device != device:
        raise bad_value(arg, f"a tensor on {device} (the layer's parameters)", x.device)


def _is_int(x: object) -> bool:
    """An integer, Python's or numpy's (``numbers.Integral``), and not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class STULayer(nn.Module):
    """x -> LN -> [u|v|q|k] -> a = hstu_mha(q, k, v) -> y = dropout(silu(u) * LN(a)) -> x + W [silu(u), a, y].

    Takes jagged ``x (total, D)`` and returns ``(total, D)``; the mask (``attn_func`` or the fixed-rule
    arguments) is built once per batch by the caller and passed through ``mask_kwargs``. With
    ``cfg.rel_bias`` the layer's relative attention bias, read at ``timestamps (total,)``, enters the
    attention call (``hstu_mha(rel_bias=...)``).
    """

    def __init__(self, cfg: STULayerConfig):
        super().__init__()
        self.cfg = cfg
        h, da, dh = cfg.num_heads, cfg.attention_dim, cfg.hidden_dim
        self.norm = nn.LayerNorm(cfg.embedding_dim)
        self.uvqk = nn.Linear(cfg.embedding_dim, h * (2 * dh + 2 * da))
        self.attn_norm = nn.LayerNorm(h * dh)
        self.out = nn.Linear(3 * h * dh, cfg.embedding_dim)
        self.rel_bias = RelativeTimePositionBias(cfg.rel_bias_max_len, cfg.rel_bias_buckets) if cfg.rel_bias else None

    def compiles(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x, ...)`` compiles (never when the caller already runs under torch.compile)."""
        if torch.compiler.is_compiling():
            return False
        return x.is_cuda if self.cfg.compile is None else self.cfg.compile

    def forward(
        self,
        x: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        timestamps: torch.Tensor | None = None,
        **mask_kwargs,
    ) -> torch.Tensor:
        check_rows(x, self.cfg.embedding_dim, (self.uvqk.weight.dtype, self.norm.weight.dtype), self.uvqk.weight.device)
        if self.rel_bias is not None:
            if timestamps is None:
                raise bad_value(
                    "timestamps", "the (total,) event times (this layer has a relative attention bias)", None
                )
            mask_kwargs = {**mask_kwargs, "rel_bias": self.rel_bias(timestamps)}
        compiles = self.compiles(x)
        if compiles and not self.cfg.recompute:
            # The whole body is traced: the custom op builds its own plan in the graph (a plan object as a
            # graph input would be guarded on, and every batch brings a new one).
            mask_kwargs = {k: val for k, val in mask_kwargs.items() if k != "attn_plan"}
            return _compiled_body(self.cfg.compile_backend)(self, x, seq_offsets, max_seq_len, mask_kwargs)
        bodies = compiled_bodies(self.cfg.compile_backend) if compiles else EAGER
        return self.body(x, seq_offsets, max_seq_len, mask_kwargs, bodies)

    def body(
        self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, mask_kwargs: dict, bodies=EAGER
    ) -> torch.Tensor:
        """The layer: the lean functions (running ``bodies``) when ``cfg.recompute``, else plain autograd."""
        cfg = self.cfg
        h, da, dh = cfg.num_heads, cfg.attention_dim, cfg.hidden_dim
        sizes = [h * dh, h * dh, h * da, h * da]
        p = cfg.dropout if self.training else 0.0
        keep = dropout_keep((x.shape[0], h * dh), p, x.device) if p > 0.0 else None
        if cfg.recompute:
            lean, (w_in, b_in, w_out, b_out) = _lean_context(
                x, (self.uvqk.weight, self.uvqk.bias, self.out.weight, self.out.bias)
            )
            with lean:
                u, v, q, k = NormLinear.apply(
                    x, self.norm.weight, self.norm.bias, w_in, b_in, self.norm.eps, sizes, bodies, cfg.rebuilds_u
                )
        else:
            u, v, q, k = torch.split(self.uvqk(self.norm(x)), sizes, dim=-1)
        # q, k, v stay views of the projection's output: the attention saves them without a copy.
        a = hstu_mha(
            max_seq_len,
            None,
            q.reshape(-1, h, da),
            k.reshape(-1, h, da),
            v.reshape(-1, h, dh),
            seq_offsets,
            kernel=cfg.kernel,
            **mask_kwargs,
        ).reshape(-1, h * dh)
        if cfg.recompute:
            with lean:
                return GatedOutput.apply(
                    x,
                    u,
                    a,
                    self.attn_norm.weight,
                    self.attn_norm.bias,
                    w_out,
                    b_out,
                    self.attn_norm.eps,
                    keep,
                    p,
                    bodies,
                    (self.norm.weight, self.norm.bias, self.norm.eps, w_in, b_in) if cfg.rebuilds_u else None,
                )
        su = F.silu(u)
        y = gate(su, self.attn_norm(a), keep, p)
        return x + self.out(torch.cat([su, a, y], dim=-1))


def _lean_context(x: torch.Tensor, weights: tuple) -> tuple:
    """How the lean functions run: ``(context, weights)``. Outside autocast, as they are (``nullcontext``, the
    weights themselves). Under autocast, with autocast off and the matmul weights cast to its dtype here, where
    autograd sees the cast (their gradients reach the float32 parameters): a Function's backward runs in whatever
    autocast state ``backward()`` is called in (usually none), so casting inside would leave the backward's
    matmuls with mixed dtypes (``stu_lean``'s docstring)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext(), weights
    dtype = torch.get_autocast_dtype(device_type)
    # autocast's own rule: float64 is never cast (a float64 model stays float64 under autocast)
    cast = tuple(w if w is None or w.dtype in (dtype, torch.float64) else w.to(dtype) for w in weights)
    return torch.autocast(device_type, enabled=False), cast


def _run_body(layer: STULayer, x, seq_offsets, max_seq_len, mask_kwargs):
    return layer.body(x, seq_offsets, max_seq_len, mask_kwargs)


@functools.cache
def _compiled_body(backend: str):
    """The plain body under torch.compile; one function for every layer (parameters are graph inputs)."""
    return torch.compile(_run_body, backend=backend)


MASK_ARGS = frozenset(
    {"attn_func", "num_targets", "causal", "max_attn_len", "contextual_seq_len", "min_full_attn_seq_len"}
)
"""The mask arguments ``STUStack.forward`` passes to ``build_plan`` and to every layer's ``hstu_mha``."""


class STUStack(nn.Module):
    """``num_layers`` STU layers run on one mask and one block plan, both made once per batch, then a final
    layer norm.

    ``timestamps (total,)`` reach every layer; those with ``cfg.rel_bias`` need them, the others ignore them.
    ``attn_scale``: None, or a floating ``()`` or ``(total,)`` tensor that every layer's attention multiplies
    by instead of dividing by ``max_seq_len`` (``hstu_mha``'s); ``max_seq_len`` is then a length bound only.
    ``attn_plan``: the batch's ``flexhstu.build_plan`` for this mask, or None to build it here (``sparse``
    passed on: True for windows and SLA-like funcs); every layer's attention, forward and backward, uses it.
    """

    def __init__(self, cfg: STULayerConfig, num_layers: int):
        super().__init__()
        # 0 layers: the final norm alone (kept on purpose); a negative count built that too, with no error
        self.layers = nn.ModuleList(STULayer(cfg) for _ in range(as_int("num_layers", num_layers)))
        self.norm = nn.LayerNorm(cfg.embedding_dim)

    def forward(
        self,
        x: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        timestamps: torch.Tensor | None = None,
        *,
        attn_plan: AttnPlan | None = None,
        sparse: bool | None = None,
        attn_scale: torch.Tensor | None = None,
        **mask_kwargs,
    ) -> torch.Tensor:
        check_rows(x, self.norm.normalized_shape[0])  # dtype and device in each layer (FSDP casts per layer)
        unknown = sorted(set(mask_kwargs) - MASK_ARGS)
        if unknown:  # else build_plan's own TypeError, naming a function the caller never called
            raise bad_type(
                unknown[0], f"one of STUStack.forward's mask arguments {sorted(MASK_ARGS)}", "an unknown keyword"
            )
        if attn_plan is not None and sparse is not None:
            raise bad_value(
                "sparse", "None when attn_plan is given (the plan's tiles are chosen when it is built)", sparse
            )
        if attn_plan is None:
            attn_plan = build_plan(seq_offsets, total=x.shape[0], max_seq_len=max_seq_len, sparse=sparse, **mask_kwargs)
        if attn_scale is not None:
            mask_kwargs = {**mask_kwargs, "attn_scale": attn_scale}
        for layer in self.layers:
            x = layer(x, seq_offsets, max_seq_len, timestamps, attn_plan=attn_plan, **mask_kwargs)
        if self.layers and self.layers[0].compiles(x) and _plain_layer_norm(self.norm):
            # Compiled with the layers: eager LayerNorm's weight and bias gradients were 0.28 ms of a 13 ms window
            # step (H100, B16 S4096, 4 layers of 512: one slow column reduction, benchmarks/profile_stu.py).
            norm = _compiled_layer_norm(self.layers[0].cfg.compile_backend)
            return norm(x, self.norm.weight, self.norm.bias, self.norm.eps)
        return self.norm(x)


def _plain_layer_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is the stack's own ``nn.LayerNorm`` with weight and bias and no hooks, which the compiled
    function may stand in for (a replaced module or a hook must run as the user set it)."""
    return (
        type(norm) is nn.LayerNorm
        and norm.weight is not None
        and norm.bias is not None
        and not (norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks or norm._backward_pre_hooks)
    )


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@functools.cache
def _compiled_layer_norm(backend: str):
    """The stack's final norm under torch.compile, forward and backward; one function for every stack."""
    return torch.compile(_layer_norm, backend=backend)
