"""Tile sweep for the kernels on configuration C (causal and SLA): ``python benchmarks/sweep.py``.

Runs each candidate tile of one kernel at a time (``tile_override``) and prints
median times, so the defaults in ops/triton/config.py can be chosen from data.
"""

import torch
import triton

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.jagged import offsets_from_lengths
from flexhstu.ops.triton.config import Tile, tile_override

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2)]
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 4, 2)]


def main():
    b, s, h, d = 4, 8192, 4, 128
    offs = offsets_from_lengths([s] * b, device="cuda")
    q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    cases = {"causal": {}, "sla": {"attn_func": masks.sla(offs, 256, 32)}}
    for kname, opts in (("forward", FWD), ("dq", DQ), ("dkdv", DKDV)):
        for spec in opts:
            tile = Tile(*spec)
            cells = []
            for cname, kw in cases.items():
                def fwd(kw=kw):
                    return flexhstu.hstu_mha(s, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)

                def fb(fwd=fwd):
                    return torch.autograd.grad(fwd(), (q, k, v), do)

                try:
                    with tile_override(**{kname: tile}):
                        fn = fwd if kname == "forward" else fb
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    cells.append(f"{cname} {'fwd' if kname == 'forward' else 'fwd+bwd'} {ms:.3f} ms")
                except Exception as e:  # a tile that does not fit (shared memory) is reported, not fatal
                    cells.append(f"{cname} failed: {type(e).__name__}: {str(e)[:80]}")
            print(f"{kname:7} {','.join(map(str, spec)):12} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
