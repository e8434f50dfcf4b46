"""Peak memory of an STU stack step the way users measure it: after a reset, three forward+backward steps in a
row (gradients kept), input and its gradient included, absolute ``torch.cuda.max_memory_allocated``; and what
the forward leaves allocated for the backward. B16 S4096, 4 layers of 512, 4 heads of 128, bf16, no dropout;
the default body (u rebuilt in the backward; and kept, ``recompute_u=False``), the eager and lean bodies, causal
and window 256. CUDA only:

    PYTHONPATH=$PWD python3 benchmarks/stu_memory.py
"""

import torch

from flexhstu.jagged import offsets_from_lengths
from flexhstu.nn import STULayerConfig, STUStack

B, S, D, H, HD, NL = 16, 4096, 512, 4, 128, 4
dev = "cuda"
offs = offsets_from_lengths([S] * B, device=dev)
GiB = 2**30
for variant, kw in [
    ("default", {}),
    ("default+keep_u", dict(recompute_u=False)),
    ("eager", dict(recompute=False, compile=False)),
    ("lean", dict(recompute=True, compile=False)),
]:
    for mask in ["causal", "window"]:
        mk = {} if mask == "causal" else {"max_attn_len": 256}
        torch.manual_seed(0)
        cfg = STULayerConfig(embedding_dim=D, num_heads=H, attention_dim=HD, hidden_dim=HD, dropout=0.0, **kw)
        stack = STUStack(cfg, NL).to(dev, torch.bfloat16)
        x = torch.randn(B * S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(x)
        out = stack(x, offs, S, **mk)
        out.backward(g)  # warm-up (compiles)
        del out
        x.grad = None
        for p in stack.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        holds = []
        for _ in range(3):
            m0 = torch.cuda.memory_allocated()
            out = stack(x, offs, S, **mk)
            holds.append((torch.cuda.memory_allocated() - m0) / GiB)
            out.backward(g)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / GiB
        params = sum(p.numel() * p.element_size() for p in stack.parameters()) / GiB
        print(
            f"{variant:8s} {mask:7s} user peak {peak:.3f} GiB | before steps {base / GiB:.3f} "
            f"(x {x.numel() * 2 / GiB:.3f}, params {params:.3f}) | held after forward (for the backward + out) {holds}",
            flush=True,
        )
        del stack, x, g, out
        torch.cuda.empty_cache()
