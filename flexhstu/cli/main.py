"""The ``flexhstu`` command: demo, show-mask, bench, train.

A mistake in the input is answered with one line ``flexhstu <command>: error: ...`` and exit status 2
(see ``cli/common.py``); ``--debug`` after the command shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

from .. import Kernel, __version__, hstu_mha, masks
from ..jagged import offsets_from_lengths
from ..masks import picture
from .common import Parser, UserError, lengths_list, non_negative_int, positive_int, run, user_input


def build_mask(kind: str, offs: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    targets = torch.tensor(args.targets, dtype=torch.int64) if args.targets else None
    if kind == "causal":
        return masks.causal(offs)
    if kind == "fixed":
        return masks.fixed(
            offs,
            num_targets=targets,
            max_attn_len=args.max_attn_len,
            contextual_seq_len=args.contextual_seq_len,
            min_full_attn_seq_len=args.min_full_attn_seq_len,
        )
    if kind == "sla":
        return masks.sla(
            offs, args.sla_k1, args.sla_k2, num_targets=targets, contextual_seq_len=args.contextual_seq_len
        )
    if targets is None:  # onerank, the last of argparse's choices
        raise ValueError(
            "--targets: expected one target count per sequence (a multiple of --group-size), "
            "got none; onerank needs them"
        )
    return masks.onerank(offs, targets, args.group_size)


# A picture draws one pixel or more per (query, key) pair and one panel per sequence: past these sizes it is
# too large to read, so show-mask refuses (with the limits in the message) rather than downsampling, which
# would blur exactly the single-column intervals a mask picture is for.
MAX_PICTURE_LENGTH = 512
MAX_PICTURE_SEQUENCES = 8


def cmd_show_mask(args: argparse.Namespace) -> int:
    lengths = args.lengths
    if max(lengths) > MAX_PICTURE_LENGTH:
        raise UserError(
            f"--lengths: expected lengths up to {MAX_PICTURE_LENGTH} (one pixel per (query, key) pair; a "
            f"longer sequence's picture is unreadable), got {max(lengths)}"
        )
    if len(lengths) > MAX_PICTURE_SEQUENCES:
        raise UserError(
            f"--lengths: expected at most {MAX_PICTURE_SEQUENCES} sequences (one panel each), got {len(lengths)}"
        )
    if args.targets is not None and len(args.targets) != len(lengths):
        raise UserError(f"--targets: expected {len(lengths)} values (one per sequence), got {len(args.targets)}")
    offs = offsets_from_lengths(lengths)
    with user_input():  # the builders check the mask arguments against the lengths
        func = build_mask(args.mask, offs, args)
    with user_input("--output", lib_arg="path"):
        path = picture.render(func, offs, max(lengths + [1]), args.output, title=f"{args.mask} (NFUNC {func.shape[1]})")
    print(f"wrote {path}: {args.mask}, NFUNC {func.shape[1]}, lengths {lengths}")
    return 0


def _time_ms(fn, repeat: int = 3) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _triton_on_cpu() -> str | None:
    """Switch Triton's CPU interpreter on for this process; None when it is on, else why the Triton rows are
    skipped. The interpreter is chosen when kernels are defined, so it can only be switched on before triton
    is imported."""
    if importlib.util.find_spec("triton") is None:
        return "skipped: triton is not installed (pip install 'flexhstu[gpu]')"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if "triton" in sys.modules:
        return "skipped: triton was imported before the interpreter could be switched on (set TRITON_INTERPRET=1)"
    os.environ["TRITON_INTERPRET"] = "1"
    return None


# float32 (CPU) and bfloat16 (GPU) against the float64 reference, relative to the output's largest entry
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def cmd_demo(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    # Triton's interpreter runs every program in Python: small shapes on the CPU
    hist = [40, 0, 23, 64] if device == "cpu" else [3000, 0, 1571, 4096]
    group, ncand = 4, [3, 0, 2, 4]
    lengths = [h + group * c for h, c in zip(hist, ncand)]
    offs = offsets_from_lengths(lengths, device=device)
    n = max(lengths)
    heads, dim = 2, 32
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=dtype) for _ in range(3))
    cases = {
        "causal": masks.causal(offs),
        "sla k1=16 k2=4": masks.sla(offs, 16, 4),
        "onerank K=3": masks.onerank(offs, torch.tensor([group * c for c in ncand], device=device), group),
    }
    with user_input("--out"):
        os.makedirs(args.out, exist_ok=True)
    skipped = _triton_on_cpu() if device == "cpu" else None
    backends = [Kernel.PYTORCH] + ([Kernel.TRITON] if skipped is None else [])
    print(f"device {device}, dtype {str(dtype).replace('torch.', '')}, lengths {lengths}, heads {heads}, dim {dim}")
    print(f"{'mask':<16} {'backend':<8} {'NFUNC':>5} {'visible':>8} {'max |err|':>10} {'time_ms':>8}  check")
    failed = 0
    for name, func in cases.items():
        dense = masks.to_dense(func, offs, n)
        visible = dense.sum().item() / max(sum(L * L for L in lengths), 1)
        ref = hstu_mha(n, None, q.double(), k.double(), v.double(), offs, attn_func=func, kernel=Kernel.PYTORCH)
        bound = TOLERANCE[dtype] * max(ref.abs().max().item(), 1e-30)
        for backend in backends:
            run = lambda func=func, backend=backend: hstu_mha(n, None, q, k, v, offs, attn_func=func, kernel=backend)
            err = (run().double() - ref).abs().max().item()
            ok = err <= bound
            failed += not ok
            print(
                f"{name:<16} {backend.value:<8} {func.shape[1]:>5} {visible:>8.3f} {err:>10.2e} "
                f"{_time_ms(run, repeat=1 if device == 'cpu' else 3):>8.2f}  {'pass' if ok else 'FAIL'}"
            )
        small = offsets_from_lengths([48, 40])
        sfunc = {
            "causal": masks.causal(small),
            "sla": masks.sla(small, 12, 4),
            "onerank": masks.onerank(small, torch.tensor([16, 12]), 4),
        }
        key = name.split()[0]
        picture.render(
            sfunc[key],
            small,
            48,
            os.path.join(args.out, f"mask-{key}.png"),
            title=f"{key} (NFUNC {sfunc[key].shape[1]})",
        )
    if skipped is not None:
        print(f"triton: {skipped}")
    print(f"mask pictures in {args.out}/")
    if failed:
        print(f"{failed} check(s) failed", file=sys.stderr)
        return 1
    return 0


def build_parser() -> Parser:
    """The ``flexhstu`` parser; ``train`` and ``bench`` parse their own arguments (``flexhstu train --help``)."""
    parser = Parser(prog="flexhstu", description="HSTU attention under interval masks")
    parser.add_argument("--version", action="version", version=f"flexhstu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    demo = sub.add_parser(
        "demo",
        help="run hstu_mha on SLA and OneRank masks, check it, draw the masks",
        description="Run hstu_mha (and the Triton kernels where they can run) on causal, SLA and "
        "OneRank masks, compare each with the float64 reference, draw the masks. "
        "Exit status 1 if a check fails.",
    )
    demo.add_argument("--out", default="flexhstu-demo", help="folder for the mask pictures")
    demo.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random q, k, v")
    demo.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    demo.set_defaults(fn=cmd_demo, parser=demo)

    show = sub.add_parser(
        "show-mask",
        help="draw a mask as a PNG, one panel per sequence",
        description="Draw a mask as a PNG, one panel per sequence (query rows down, key columns "
        f"across; up to {MAX_PICTURE_SEQUENCES} sequences of length up to "
        f"{MAX_PICTURE_LENGTH}).",
    )
    show.add_argument("mask", choices=["causal", "fixed", "sla", "onerank"], help="the mask builder")
    show.add_argument(
        "--lengths", type=lengths_list, required=True, help="comma-separated sequence lengths, e.g. 40,64"
    )
    show.add_argument(
        "--targets", type=lengths_list, default=None, help="comma-separated target counts, one per sequence"
    )
    show.add_argument("--sla-k1", type=positive_int, default=8, help="sla: local causal window K1")
    show.add_argument("--sla-k2", type=non_negative_int, default=4, help="sla: global prefix K2")
    show.add_argument("--group-size", type=positive_int, default=4, help="onerank: tokens per candidate, K + 1")
    show.add_argument("--max-attn-len", type=non_negative_int, default=0, help="fixed: attention window (0: none)")
    show.add_argument(
        "--contextual-seq-len", type=non_negative_int, default=0, help="fixed, sla: contextual prefix length"
    )
    show.add_argument(
        "--min-full-attn-seq-len", type=non_negative_int, default=0, help="fixed: last rows that see past the window"
    )
    show.add_argument("-o", "--output", default="mask.png", help="the PNG to write")
    show.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    show.set_defaults(fn=cmd_show_mask, parser=show)

    bench = sub.add_parser(
        "bench",
        help="time hstu_mha against SDPA on a GPU (see flexhstu bench --help); "
        "--serving: cached scoring against full recompute (flexhstu bench --serving --help)",
        add_help=False,
    )
    bench.set_defaults(fn=lambda a: _bench_main(a.rest))

    train = sub.add_parser("train", help="train and evaluate a model (see flexhstu train --help)", add_help=False)
    train.set_defaults(fn=lambda a: _train_main(a.rest))

    rec = sub.add_parser(
        "recommend", help="top-K items per user from a trained run (see flexhstu recommend --help)", add_help=False
    )
    rec.set_defaults(fn=lambda a: _recommend_main(a.rest))
    return parser


PASS_THROUGH = ("bench", "train", "recommend")  # commands that parse their own arguments


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in PASS_THROUGH and rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.command in PASS_THROUGH:
        return args.fn(args)
    return run(f"flexhstu {args.command}", lambda: args.fn(args), args.debug)


def _train_main(rest: list[str]) -> int:
    from .. import train

    return train.cli(rest)


def _recommend_main(rest: list[str]) -> int:
    from .. import recommend

    return recommend.cli(rest)


def _bench_main(rest: list[str]) -> int:
    from .. import bench  # --model-step and --serving pick the benchmark, which parses its own options

    return bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
