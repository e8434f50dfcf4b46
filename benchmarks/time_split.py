"""Where the time goes: host time per call (no sync) and per-kernel device time, for a few configurations.

``python benchmarks/time_split.py``: prints, per configuration, the host microseconds of
one forward and one forward+backward call (launch-bound when larger than device
time) and the device time of every kernel from torch.profiler.
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import flexhstu
from flexhstu import Kernel, masks
from flexhstu.jagged import offsets_from_lengths


def main():
    cfgs = {
        "A causal B32 S1024": ([1024] * 32, {}),
        "C causal": ([8192] * 4, {}),
        "C sla": ([8192] * 4, "sla"),
        "C targets": ([8192] * 4, "targets"),
        "L sla": ([131072], "sla"),
    }
    for name, (lengths, kw) in cfgs.items():
        profile_config(name, lengths, kw)


def profile_config(name, lengths, kw):
    """Host time per call and per-kernel device time of one configuration."""
    offs = offsets_from_lengths(lengths, device="cuda")
    total, n = sum(lengths), max(lengths)
    if kw == "sla":
        kw = {"attn_func": masks.sla(offs, 256, 32)}
    elif kw == "targets":
        kw = {"num_targets": torch.full((len(lengths),), 256, device="cuda")}
    q, k, v = (torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def fwd():
        return flexhstu.hstu_mha(n, None, q, k, v, offs, kernel=Kernel.TRITON, **kw)

    def fb():
        return torch.autograd.grad(fwd(), (q, k, v), do)

    for _ in range(3):
        fb()
    torch.cuda.synchronize()
    host = {}
    for label, fn in (("fwd", fwd), ("fwd+bwd", fb)):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host[label] = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fb()
        torch.cuda.synchronize()
    print(f"\n== {name}: host us/call fwd {host['fwd']:.0f}, fwd+bwd {host['fwd+bwd']:.0f}")
    if name.startswith("A"):
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(20):
            fb()
        prof_host.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(14)
    rows = [(e.key, e.device_time_total / 5, e.count / 5) for e in prof.key_averages()]
    for key, us, cnt in sorted(rows, key=lambda r: -r[1])[:8]:
        print(f"   {us:9.1f} us  x{cnt:.0f}  {key[:70]}")


if __name__ == "__main__":
    main()
