"""Where the relative bias's kernel time goes: the bias timed with one part of its work taken out at a time.

``python benchmarks/bias_ablations.py [--only causal] [--out DIR]`` (on the GPU): writes copies of the
package under ``build/bias-ablations/<variant>/flexhstu`` with one edit each, then runs
``benchmarks/bench_bias.py --kernels`` once per copy (its own process, ``PYTHONPATH`` on the copy) and
prints the forward+backward time with the bias and the per-kernel times of every variant next to the
unmodified one (``none``). The variants compute wrong results on purpose; they are timed, never used:

* ``no-grads``: the dK/dV kernel skips the table gradients (``bias_grad``);
* ``no-pos-grad``: the tables' gradients without the position part (diagonal sums and their atomics);
* ``one-pos-atomic``: the position part's diagonal sums, added in one atomic per tile (the atomics' cost);
* ``no-time-grad``: the gradients without the time-bucket part;
* ``no-pos-add``: the scores without the position entries (forward, dQ and dK/dV);
* ``no-time-add``: the scores without the time-bucket weights;
* ``one-bucket``: every tile as if all its pairs fell in one bucket (the tile's bucket range is still found,
  from the blocks' time summaries, but no pair is compared with an edge): ``none`` less this is the per-pair
  edge work, this less ``no-time-add`` the per-tile set-up (the blocks' time bounds, the range's buckets).

``--build-only`` writes the copies and exits (what the CPU test checks: every edit still applies). ``--jobs N``
first runs every copy once in N processes at a time (one repeat, results dropped) so that the timed runs, one
at a time, find their kernels compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIAS, DKDV = "ops/triton/bias_tiles.py", "ops/triton/backward.py"
POS_GRAD = "    # Positions: diagonal sums"
TIME_GRAD = "    # Time buckets: per bucket"
POS_ATOMIC = 'tl.atomic_add(dpos + d, diag, mask=(uu[:, None] < NU) & (ee[None, :] < 2 * G - 1), sem="relaxed")'


def _replace(old: str, new: str):
    def edit(text: str) -> str:
        if old not in text:
            raise ValueError(f"bias_ablations: the source no longer holds {old.strip()[:60]!r}: update the edit")
        return text.replace(old, new)

    return edit


def _cut(start: str, end: str | None):
    """Remove the text from ``start`` up to ``end`` (to the end of the file when None)."""

    def edit(text: str) -> str:
        if start not in text or (end is not None and end not in text):
            raise ValueError(f"bias_ablations: the source no longer holds {start.strip()[:60]!r}: update the edit")
        i = text.index(start)
        return text[:i] + (text[text.index(end) :] if end is not None else "")

    return edit


def _both(*edits):
    def edit(text: str) -> str:
        for e in edits:
            text = e(text)
        return text

    return edit


VARIANTS = {
    "no-grads": [(DKDV, _replace("            if BIAS_GRAD:\n", "            if False:\n"))],
    "no-pos-grad": [(BIAS, _cut(POS_GRAD, None))],  # bias_grad is the file's last function
    "one-pos-atomic": [
        (BIAS, _replace(POS_ATOMIC, 'tl.atomic_add(dpos, tl.sum(tl.sum(diag, axis=1), axis=0), sem="relaxed")'))
    ],
    "no-time-grad": [(BIAS, _cut(TIME_GRAD, POS_GRAD))],
    "no-pos-add": [
        (
            BIAS,
            _both(
                _replace(
                    "        s += _gather(posw + (cols[:, None] - rows[None, :]), DOT_PRECISION)",
                    "        s = s",
                ),
                _replace(
                    "        s += _gather(posw + (cols[None, :] - rows[:, None]), DOT_PRECISION)",
                    "        s = s",
                ),
            ),
        )
    ],
    "no-time-add": [
        (
            BIAS,
            _both(
                _replace("s = _add_wide_time_steps(s, tsw, bias, seq_start, L, rows, cols, TRANS)", "s = s"),
                _replace(
                    "s = _add_time_steps(s, tsw, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS,\n"
                    "                                DOT_PRECISION)",
                    "s = s",
                ),
                _replace(
                    "s = _add_time_steps(s, tsw, bias, seq_start, L, rows, cols, ai, bi, d, b_lo, b_hi, sgn, TRANS,\n"
                    "                            DOT_PRECISION)",
                    "s = s",
                ),
            ),
        )
    ],
    "one-bucket": [
        (
            BIAS,
            _replace(
                "    return bucket_of(bias, gmin), bucket_of(bias, gmax), sgn\n",
                "    b = bucket_of(bias, gmin)\n    return b, b, sgn\n",
            ),
        )
    ],
}


def build(dest: pathlib.Path) -> dict[str, pathlib.Path]:
    """The package copies, one per variant (``none``: unmodified), each under ``dest/<variant>``."""
    made = {}
    for name, edits in {"none": [], **VARIANTS}.items():
        pkg = dest / name / "flexhstu"
        if pkg.exists():
            shutil.rmtree(pkg)
        shutil.copytree(ROOT / "flexhstu", pkg, ignore=shutil.ignore_patterns("__pycache__"))
        for rel, edit in edits:
            path = pkg / rel
            path.write_text(edit(path.read_text()))
        made[name] = dest / name
    return made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="causal", help="bench_bias.py's --only (causal, sla or both: causal,sla)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dest", default=str(ROOT / "build" / "bias-ablations"))
    p.add_argument("--out", default="", help="folder for each variant's log and JSON (default: --dest)")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="processes of the compiling pass (1: no such pass)")
    a = p.parse_args()
    made = build(pathlib.Path(a.dest))
    if a.build_only:
        print("\n".join(f"{name}: {path}" for name, path in made.items()))
        return 0
    out = pathlib.Path(a.out or a.dest)
    out.mkdir(parents=True, exist_ok=True)
    bench = [sys.executable, str(ROOT / "benchmarks" / "bench_bias.py"), "--only", a.only]
    if a.jobs > 1:
        names = list(made)
        for i in range(0, len(names), a.jobs):
            procs = [
                subprocess.Popen(
                    [*bench, "--repeats", "1"],
                    env={**os.environ, "PYTHONPATH": str(made[name])},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd=ROOT,
                )
                for name in names[i : i + a.jobs]
            ]
            for proc in procs:
                proc.wait()
        print(f"compiled: {len(names)} copies, {a.jobs} at a time", flush=True)
    results = {}
    for name, path in made.items():
        js = out / f"ablation-{name}.json"
        cmd = [*bench, "--repeats", str(a.repeats), "--kernels", "--json", str(js)]
        env = {**os.environ, "PYTHONPATH": str(path)}
        with open(out / f"ablation-{name}.log", "w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        results[name] = json.loads(js.read_text()) if rc == 0 and js.is_file() else None
        print(f"{name}: exit {rc}", flush=True)
    print("\n| variant | config | fwd ms | fwd+bwd ms | kernels (us) |\n|---|---|---|---|---|")
    for name, rows in results.items():
        for r in rows or [{"name": "failed: see its log"}]:
            kernels = ", ".join(f"{k.split('(')[0][:32]} {v:.0f}" for k, v in r.get("bias_kernels_us", {}).items())
            print(
                f"| {name} | {r['name']} | {r.get('bias_fwd_ms', float('nan')):.3f} "
                f"| {r.get('bias_fb_ms', float('nan')):.3f} | {kernels} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
