"""Where the STU stack's step goes: per-kernel device time of one forward+backward (torch.profiler).

``python benchmarks/profile_stu.py [--mask causal|window]``: the issue's configuration (4 layers,
embedding 512, 4 heads of 128, B16 S4096, bf16, no dropout), default layer (lean body, compiled),
three warm-up steps, then one profiled step; prints the kernels by total device time, grouped into
attention (the hstu kernels) and the layer body (everything else).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from flexhstu.jagged import offsets_from_lengths
from flexhstu.nn import STULayerConfig, STUStack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mask", choices=["causal", "window"], default="window")
    a = p.parse_args()
    torch.manual_seed(0)
    b, s, dim = 16, 4096, 512
    offs = offsets_from_lengths([s] * b, device="cuda")
    cfg = STULayerConfig(embedding_dim=dim, num_heads=4, attention_dim=128, hidden_dim=128, dropout=0.0)
    stack = STUStack(cfg, 4).cuda().to(torch.bfloat16)
    x = torch.randn(b * s, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    kw = {"max_attn_len": 256} if a.mask == "window" else {}
    for _ in range(3):
        stack(x, offs, s, **kw).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stack(x, offs, s, **kw).backward(grad)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    attn = sum(t for k, t, _ in rows if "hstu_" in k or "_plan_kernel" in k or "_block_table" in k)
    total = sum(t for _, t, _ in rows)
    print(
        f"STU step, {a.mask}: device total {total / 1e3:.2f} ms, attention kernels {attn / 1e3:.2f} ms, "
        f"layer body {(total - attn) / 1e3:.2f} ms"
    )
    for key, t, n in rows[:18]:
        print(f"  {t / 1e3:8.3f} ms  x{n:<3} {key[:90]}")


if __name__ == "__main__":
    main()
