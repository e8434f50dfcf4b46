"""A fixed workload for Nsight Compute: the relative bias, causal B4 S8192 H4 D128 bf16 (``bench_bias.py``'s).

Four forward+backward passes with the table bias, so that ``ncu --launch-skip 2`` picks a warm launch::

    ncu --clock-control none -k regex:hstu_forward --launch-skip 2 --launch-count 1 --set full \\
        python benchmarks/ncu_bias.py [causal|sla]
"""

import sys

import torch
from bench_bias import timestamps


def main() -> int:
    from flexhstu import Kernel, hstu_mha, masks
    from flexhstu.jagged import offsets_from_lengths
    from flexhstu.ops.bias import RelativeBias

    mask = sys.argv[1] if len(sys.argv) > 1 else "causal"
    torch.manual_seed(0)
    b, n, h, d = 4, 8192, 4, 128
    lengths = [n] * b
    offs = offsets_from_lengths(lengths, device="cuda")
    q, k, v = (torch.randn(b * n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    kw = {"attn_func": masks.sla(offs, 256, 32, total=b * n)} if mask == "sla" else {}
    pos_w = (torch.randn(2 * n - 1, device="cuda") * 0.02).requires_grad_(True)
    ts_w = (torch.randn(129, device="cuda") * 0.02).requires_grad_(True)
    bias = RelativeBias(pos_w, ts_w, timestamps(lengths, "sorted").cuda())
    for _ in range(4):
        out = hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, rel_bias=bias, **kw)
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
