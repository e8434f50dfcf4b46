"""Which STU configurations capture in a CUDA graph (torch.cuda.make_graphed_callables), each in its own process.

    PYTHONPATH=$PWD python benchmarks/graph_check.py

A failed capture leaves the process's CUDA state unusable, so every variant runs in a fresh interpreter.
Variants: the attention alone (hstu_mha with a plan), and the STU stack with the lean body (recompute) or
the plain one, compiled or eager, on causal and SLA masks. Prints one line per variant: ok with the
largest relative difference from eager, or the error's last line.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

CHILD = r"""
import sys, torch, flexhstu
from flexhstu import masks
from flexhstu.nn import STULayerConfig, STUStack
what, mask, recompute, compile_ = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
torch.manual_seed(0)
lengths = [2048, 777, 0, 1500]
offs = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
total, n = sum(lengths), max(lengths)
kw = {} if mask == "causal" else {"attn_func": masks.sla(offs, 256, 32, total=total)}
plan = flexhstu.build_plan(offs, total=total, max_seq_len=n, sparse=mask != "causal", **kw)
if what == "attention":
    class Step(torch.nn.Module):
        def forward(self, x):
            q, k, v = x.view(total, 2, 3, 64).unbind(2)
            return flexhstu.hstu_mha(n, None, q, k, v, offs, attn_plan=plan, **kw)
    step, width, params = Step(), 384, []
else:
    cfg = STULayerConfig(embedding_dim=256, num_heads=2, attention_dim=64, hidden_dim=64, dropout=0.0,
                         recompute=recompute, compile=compile_)
    stack = STUStack(cfg, 2).cuda().to(torch.bfloat16)
    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = stack
        def forward(self, x):
            return self.stack(x, offs, n, attn_plan=plan, **kw)
    step, width, params = Step(), 256, list(stack.parameters())
x = torch.randn(total, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dout = torch.randn(total, 384 if what == "attention" else 256, device="cuda", dtype=torch.bfloat16)
if what == "attention":
    dout = dout[:, :128].reshape(total, 2, 64)
# Captured before any eager run: an eager graph still alive at capture time holds the parameters' gradient
# accumulators, created on the default stream, and the captured backward would have to wait on that stream.
graphed = torch.cuda.make_graphed_callables(step, (x.detach().clone().requires_grad_(True),))
out_e = step(x)
ge = torch.autograd.grad(out_e, [x, *params], dout)
del out_e
xg = x.detach().clone().requires_grad_(True)
out_g = graphed(xg)
gg = torch.autograd.grad(out_g, [xg, *params], dout)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
out_e = step(x.detach().clone())
print(max([rel(out_g, out_e)] + [rel(a, b) for a, b in zip(gg, ge)]))
"""


def main() -> int:
    variants = [("attention", m, "0", "0") for m in ("causal", "sla")]
    variants += [("stu", "causal", r, c) for r, c in itertools.product("10", "10")]
    variants += [("stu", "sla", "1", "1")]
    for v in variants:
        p = subprocess.run([sys.executable, "-c", CHILD, *v], capture_output=True, text=True, timeout=240)
        name = f"{v[0]} {v[1]} recompute={v[2]} compile={v[3]}"
        if p.returncode == 0:
            print(f"ok    {name}: max rel diff {float(p.stdout.split()[-1]):.2e}", flush=True)
        else:
            lines = [x for x in (p.stderr or "").splitlines() if x.strip()]
            err = next((x for x in reversed(lines) if "Error" in x), lines[-1] if lines else "?")
            print(f"FAIL  {name}: {err.strip()[:200]}", flush=True)
            frames = [x.strip() for x in lines if x.strip().startswith("File ") and "flexhstu" in x]
            for f in frames[-4:]:
                print(f"        {f[:200]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
