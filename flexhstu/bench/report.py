"""The benchmarks' markdown tables: rows in, text out (what is measured is in the benchmark modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .timing import Timing, fmt

if TYPE_CHECKING:
    from .attention import Row
    from .serving_aoti import AotiRow
    from .serving_kernel import KernelRow
    from .serving_scoring import ScoringRow
    from .stu_step import StepRow


# ---------------------------------------------------------------------------------------------------------------
# Attention (flexhstu bench)


def attention_table(rows: list[Row]) -> str:
    """Ours in CUDA-graph replays with TFLOP/s and efficiency over causal C's (when C ran), then eager calls and
    the softmax baselines."""
    nan = Timing()
    ref = next((r for r in rows if r.name.startswith("C causal")), None)
    ref_fwd = ref.tflops(ref.ours["graph_fwd"].ms, True) if ref else float("nan")
    ref_fb = ref.tflops(ref.ours["graph_fb"].ms, False) if ref else float("nan")
    lines = [
        "Ours (device time, CUDA-graph replay; spread = (max-min)/median of the repeats):",
        "",
        "| config | NFUNC | pairs (M) | fwd ms | spread | fwd TFLOP/s | fwd eff / C | fwd+bwd ms | spread "
        "| fwd+bwd TFLOP/s | fwd+bwd eff / C |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        gf, gb = r.ours["graph_fwd"], r.ours["graph_fb"]
        tf, tb = r.tflops(gf.ms, True), r.tflops(gb.ms, False)
        lines.append(
            f"| {r.name} | {r.nfunc} | {r.pairs / 1e6:.1f} | {gf.ms:.3f} | {gf.spread:.1%} | {tf:.0f} "
            f"| {fmt(tf / ref_fwd, '.2f')} | {gb.ms:.3f} | {gb.spread:.1%} | {tb:.0f} "
            f"| {fmt(tb / ref_fb, '.2f')} |"
        )
    lines += [
        "",
        "Eager calls (host work included), and the softmax baselines on the same shapes and masks:",
        "",
        "| config | first call s | fwd ms | fwd+bwd ms | spread | host-bound fwd+bwd (eager / graph) "
        "| SDPA fwd ms | SDPA fwd+bwd ms | SDPA fwd+bwd graph ms | SDPA / ours fwd+bwd graph "
        "| Flex fwd ms | Flex fwd+bwd ms | spread | Flex / ours fwd | Flex / ours fwd+bwd | Flex compile s |",
        "|" + "---|" * 16,
    ]
    for r in rows:
        o, s, fx = r.ours, r.sdpa, r.flex
        ef, eb, gf, gb = o["eager_fwd"], o["eager_fb"], o["graph_fwd"], o["graph_fb"]
        sg = s.get("graph_fb", nan).ms
        ffw, ffb = fx.get("eager_fwd", nan), fx.get("eager_fb", nan)
        lines.append(
            f"| {r.name} | {r.first_call_s:.1f} | {ef.ms:.3f} | {eb.ms:.3f} | {eb.spread:.1%} | {eb.ms / gb.ms:.2f} "
            f"| {fmt(s.get('eager_fwd', nan).ms, '.3f')} | {fmt(s.get('eager_fb', nan).ms, '.3f')} | {fmt(sg, '.3f')} "
            f"| {fmt(sg / gb.ms, '.2f')} | {fmt(ffw.ms, '.3f')} | {fmt(ffb.ms, '.3f')} | {fmt(ffb.spread, '.1%')} "
            f"| {fmt(ffw.ms / gf.ms, '.2f')} | {fmt(ffb.ms / gb.ms, '.2f')} | {fmt(r.flex_compile_s, '.1f')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# STU stack step (flexhstu bench --model-step): printed row by row as the variants finish

STEP_HEADER = "| config | variant | step ms | step peak GiB | peak GiB (3 steps, absolute) |\n|---|---|---:|---:|---:|"


def step_row(r: StepRow) -> str:
    return f"| {r.config} | {r.variant} | {r.step_ms:.2f} | {fmt(r.step_peak_gib, '.2f')} | {fmt(r.peak_gib, '.2f')} |"


# ---------------------------------------------------------------------------------------------------------------
# Serving (flexhstu bench --serving)


def scoring_table(rows: list[ScoringRow]) -> str:
    """Speed-ups of every row against the full recompute in one forward, and of cached rows against the full
    recompute at the same micro-batch size (``-`` where there is none)."""
    full = {(r.hist, r.cands, r.layers, r.users, r.micro_batch): r.median_ms for r in rows if r.path == "full"}
    lines = [
        "| history | cands/user | layers | users | path | micro-batch | median ms | p99 ms | host ms | cands/s "
        "| speed-up vs full | vs full, same micro-batch | rel diff | status |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        key = (r.hist, r.cands, r.layers, r.users)
        base, same = full.get((*key, None)), full.get((*key, r.micro_batch))
        speed = base / r.median_ms if base and r.median_ms else None
        cached = r.path.startswith("cached")
        speed_same = same / r.median_ms if cached and r.micro_batch and same and r.median_ms else None
        mb = ("-" if r.path == "full" else "all") if r.micro_batch is None else str(r.micro_batch)
        lines.append(
            f"| {r.hist} | {r.cands} | {r.layers} | {r.users} | {r.path} | {mb} | {fmt(r.median_ms, '.2f')} "
            f"| {fmt(r.p99_ms, '.2f')} | {fmt(r.host_ms, '.2f')} | {fmt(r.cands_per_s, ',.0f')} | {fmt(speed, '.2f')} "
            f"| {fmt(speed_same, '.2f')} | {fmt(r.rel_diff, '.1e')} | {r.status} |"
        )
    return "\n".join(lines)


def kernel_table(rows: list[KernelRow]) -> str:
    lines = [
        "| history | cands/user | users | kernel | pairs (M) | device ms | TFLOP/s | eager ms | status |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        pairs = None if r.pairs is None else r.pairs / 1e6
        lines.append(
            f"| {r.hist} | {r.cands} | {r.users} | {r.kernel} | {fmt(pairs, '.1f')} | {fmt(r.ms, '.3f')} "
            f"| {fmt(r.tflops, '.0f')} | {fmt(r.eager_ms, '.3f')} | {r.status} |"
        )
    return "\n".join(lines)


def aoti_table(rows: list[AotiRow]) -> str:
    lines = [
        "| history | layers | users | cands/user | eager median ms | eager p99 ms | AOTI median ms | AOTI p99 ms "
        "| speed-up | rel diff | check | compile s | status |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        speed = r.eager_median_ms / r.aoti_median_ms if r.eager_median_ms and r.aoti_median_ms else None
        check = "-" if r.passed is None else ("pass" if r.passed else f"FAIL (> {r.tolerance:g})")
        lines.append(
            f"| {r.hist} | {r.layers} | {r.users} | {r.cands} | {fmt(r.eager_median_ms, '.2f')} "
            f"| {fmt(r.eager_p99_ms, '.2f')} | {fmt(r.aoti_median_ms, '.2f')} | {fmt(r.aoti_p99_ms, '.2f')} "
            f"| {fmt(speed, '.2f')} | {fmt(r.rel_diff, '.1e')} | {check} | {r.compile_s:.0f} | {r.status} |"
        )
    return "\n".join(lines)
