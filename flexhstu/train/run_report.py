"""The run's report: tokens/s (``Throughput``), ``metrics.json`` (no NaN: JSON has none), the ``metrics.png``
plot, and the lines printed at the end."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..models.ranking import TASKS
from .options import BUILTIN_DATA
from .run_folder import latest_after_output

WARMUP_STEPS = 3  # steps of each invocation left out of the steady tokens/s (allocation, kernel compilation)


class Throughput:
    """Input tokens and seconds of this invocation's training steps, all of them and those after the first
    ``WARMUP_STEPS`` (allocation, kernel compilation); a step is timed from its batch's assembly to its loss
    on the host (``loss.item()`` waits for the device)."""

    def __init__(self):
        self.steps, self.tokens, self.seconds = 0, 0, 0.0
        self.steady_tokens, self.steady_seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        if self.steps > WARMUP_STEPS:
            self.steady_tokens, self.steady_seconds = self.steady_tokens + tokens, self.steady_seconds + seconds

    def report(self, world: int, device: torch.device) -> dict:
        """Totals over the ranks (collective): tokens/s of all ranks together (their tokens over the slowest
        rank's seconds), per rank, and each rank's own; on CUDA each rank's peak allocated memory."""
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        mine = [self.tokens, self.seconds, self.steady_tokens, self.steady_seconds, peak]
        every = [mine] * world
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, mine)

        def rates(tokens, seconds) -> dict:
            total, slowest = sum(tokens), max(seconds)
            rate = total / slowest if slowest > 0 else 0.0
            return {
                "tokens": total,
                "seconds": slowest,
                "tokens_per_s": rate,
                "tokens_per_s_per_rank": rate / world,
                "each_rank": [t / s if s > 0 else 0.0 for t, s in zip(tokens, seconds)],
            }

        out = {"ranks": world, "steps": self.steps, **rates([e[0] for e in every], [e[1] for e in every])}
        if device.type == "cuda":
            out["peak_memory_gb"] = [e[4] / 1e9 for e in every]
        if self.steps > WARMUP_STEPS:
            out["after_warmup"] = {
                "steps": self.steps - WARMUP_STEPS,
                **rates([e[2] for e in every], [e[3] for e in every]),
            }
        return out


def throughput_line(t: dict) -> str:
    """The tokens/s report of ``Throughput.report`` in one line."""
    ranks = f"{t['ranks']} rank{'s' * (t['ranks'] > 1)}"
    line = (
        f"{t['tokens_per_s']:,.0f} tokens/s on {ranks} ({t['tokens_per_s_per_rank']:,.0f} per rank) over "
        f"{t['steps']} steps"
    )
    if "after_warmup" in t:
        w = t["after_warmup"]
        line += (
            f"; after the first {WARMUP_STEPS} steps {w['tokens_per_s']:,.0f} tokens/s "
            f"({w['tokens_per_s_per_rank']:,.0f} per rank)"
        )
    return line


def plot_title(a: argparse.Namespace) -> str:
    """Model, mask and data of a run, for its plot."""
    data = Path(a.data).name if a.data not in BUILTIN_DATA else a.data
    if a.model == "onerank":
        mask = "targets mask" if a.no_task_tokens else "task tokens"
    elif a.model == "hstu" and a.mask == "sla":
        mask = f"SLA k1={a.sla_k1} k2={a.sla_k2}"
    else:
        mask = "causal"
    return f"{a.model} ({mask}) on {data}, seed {a.seed}"


def plot(history: list[dict], path: Path, title: str, best_epoch: int | None) -> None:
    """The loss and each validation metric in a grid of at most 4 panels a row; a ranking metric's panel has
    one line per task. The best validation epoch is a dashed line in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels: dict[str, list[tuple[str, str]]] = {}  # panel title -> (line label, history key)
    for key in dict.fromkeys(k for h in history for k in h if k not in ("epoch", "seconds")):
        task = next((t for t in TASKS if key.endswith(f" {t}")), None)
        panels.setdefault(key.removesuffix(f" {task}") if task else key, []).append((task or key, key))
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 2.9 * rows + 0.5), squeeze=False)
    epochs = [h["epoch"] for h in history]
    for ax, (name, lines) in zip(axes.flat, panels.items()):
        for label, key in lines:
            ax.plot(epochs, [h.get(key, math.nan) for h in history], marker="o", markersize=3, label=label)
        if best_epoch is not None:
            ax.axvline(best_epoch, color="0.4", linestyle="--", linewidth=1, label=f"best epoch {best_epoch}")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("epoch", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(lines) > 1 or ax is axes.flat[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    checkpoint.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))  # a kill leaves the old plot
    plt.close(fig)


def json_safe(x):
    """``x`` with every NaN or infinite float as None: JSON has no NaN, and readers (jq, browsers) refuse one."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def written_metrics(out: Path) -> dict:
    """The ``metrics.json`` already in ``out``; {} when there is none (or none that reads as one)."""
    try:
        written = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return written if isinstance(written, dict) else {}


def write(result: dict, history: list[dict], out: Path, rank: int, a: argparse.Namespace) -> dict:
    """metrics.json (and metrics.png when there is a history) in ``out`` on rank 0; returns ``result``."""
    result["history"] = history
    if rank == 0:
        checkpoint.write_text(
            out / "metrics.json", json.dumps(json_safe(result), indent=1, default=str, allow_nan=False)
        )
        latest_after_output(out, rank)
        if history:
            plot(history, out / "metrics.png", plot_title(a), result.get("best_epoch"))
        if not a.quiet:
            print(json.dumps({"test": result.get("test")}))
            if "throughput" in result:
                print(f"flexhstu train: {throughput_line(result['throughput'])}")
            written = ", ".join(f.name for f in sorted(out.iterdir()) if f.is_file() and not f.name.startswith("."))
            best = f"; best epoch {result['best_epoch']} of {len(history)}" if "best_epoch" in result else ""
            print(f"flexhstu train: wrote {out}/ ({written}){best}")
    return result
