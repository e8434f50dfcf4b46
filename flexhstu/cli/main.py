"""The ``flexhstu`` command: demo, show-mask, bench, train.

A mistake in the input is answered with one line ``flexhstu <command>: error: ...`` and exit status 2
(see ``cli/common.py``); ``--debug`` after the command shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .. import Kernel, hstu_mha, masks
from ..jagged import offsets_from_lengths
from ..masks import picture
from .common import Parser, UserError, lengths_list, non_negative_int, positive_int, run, user_input


def build_mask(kind: str, offs: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    targets = torch.tensor(args.targets, dtype=torch.int64) if args.targets else None
    if kind == "causal":
        return masks.causal(offs)
    if kind == "fixed":
        return masks.fixed(offs, num_targets=targets, max_attn_len=args.max_attn_len,
                           contextual_seq_len=args.contextual, min_full_attn_seq_len=args.min_full_attn)
    if kind == "sla":
        return masks.sla(offs, args.k1, args.k2, num_targets=targets, contextual_seq_len=args.contextual)
    if targets is None:  # onerank, the last of argparse's choices
        raise ValueError("--targets: expected one target count per sequence (a multiple of --group-size), "
                         "got none; onerank needs them")
    return masks.onerank(offs, targets, args.group_size)


def cmd_show_mask(args: argparse.Namespace) -> int:
    lengths = args.lengths
    if args.targets is not None and len(args.targets) != len(lengths):
        raise UserError(f"--targets: expected {len(lengths)} values (one per sequence), got {len(args.targets)}")
    offs = offsets_from_lengths(lengths)
    with user_input():  # the builders check the mask arguments against the lengths
        func = build_mask(args.mask, offs, args)
    with user_input("--output"):
        path = picture.render(func, offs, max(lengths + [1]), args.output,
                              title=f"{args.mask} (NFUNC {func.shape[1]})")
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


def cmd_demo(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    hist = [180, 0, 97, 256] if device == "cpu" else [3000, 0, 1571, 4096]
    group, ncand = 4, [8, 0, 5, 12]
    lengths = [h + group * c for h, c in zip(hist, ncand)]
    offs = offsets_from_lengths(lengths, device=device)
    n = max(lengths)
    heads, dim = 2, 32
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=dtype) for _ in range(3))
    cases = {
        "causal": masks.causal(offs),
        "sla k1=32 k2=8": masks.sla(offs, 32, 8),
        "onerank K=3": masks.onerank(offs, torch.tensor([group * c for c in ncand], device=device), group),
    }
    with user_input("--out"):
        os.makedirs(args.out, exist_ok=True)
    print(f"device {device}, dtype {str(dtype).replace('torch.', '')}, lengths {lengths}, heads {heads}, dim {dim}")
    print(f"{'mask':<16} {'NFUNC':>5} {'visible':>8} {'max |err|':>10} {'time_ms':>8}")
    for name, func in cases.items():
        dense = masks.to_dense(func, offs, n)
        visible = dense.sum().item() / max(sum(L * L for L in lengths), 1)
        run = lambda func=func: hstu_mha(n, None, q, k, v, offs, attn_func=func)
        out = run()
        ref = hstu_mha(n, None, q.double(), k.double(), v.double(), offs, attn_func=func, kernel=Kernel.PYTORCH)
        err = (out.double() - ref).abs().max().item()
        print(f"{name:<16} {func.shape[1]:>5} {visible:>8.3f} {err:>10.2e} {_time_ms(run):>8.2f}")
        small = offsets_from_lengths([48, 40])
        sfunc = {"causal": masks.causal(small), "sla": masks.sla(small, 12, 4),
                 "onerank": masks.onerank(small, torch.tensor([16, 12]), 4)}
        key = name.split()[0]
        picture.render(sfunc[key], small, 48, os.path.join(args.out, f"mask-{key}.png"),
                       title=f"{key} (NFUNC {sfunc[key].shape[1]})")
    print(f"mask pictures in {args.out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="flexhstu", description="HSTU attention under interval masks")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run hstu_mha on SLA and OneRank masks, check it, draw the masks")
    demo.add_argument("--out", default="flexhstu-demo", help="folder for the mask pictures")
    demo.add_argument("--seed", type=non_negative_int, default=0)
    demo.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    demo.set_defaults(fn=cmd_demo)

    show = sub.add_parser("show-mask", help="draw a mask as a PNG, one panel per sequence")
    show.add_argument("mask", choices=["causal", "fixed", "sla", "onerank"])
    show.add_argument("--lengths", type=lengths_list, required=True,
                      help="comma-separated sequence lengths, e.g. 40,64")
    show.add_argument("--targets", type=lengths_list, default=None,
                      help="comma-separated target counts, one per sequence")
    show.add_argument("--k1", type=positive_int, default=8, help="sla: local window")
    show.add_argument("--k2", type=non_negative_int, default=4, help="sla: global prefix")
    show.add_argument("--group-size", type=positive_int, default=4, help="onerank: K + 1")
    show.add_argument("--max-attn-len", type=non_negative_int, default=0)
    show.add_argument("--contextual", type=non_negative_int, default=0)
    show.add_argument("--min-full-attn", type=non_negative_int, default=0)
    show.add_argument("-o", "--output", default="mask.png")
    show.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    show.set_defaults(fn=cmd_show_mask)

    bench = sub.add_parser("bench", help="time hstu_mha against SDPA on a GPU (--suite, or your own shape)",
                           add_help=False)
    bench.set_defaults(fn=lambda a: _bench_main(a.rest))

    train = sub.add_parser("train", help="train and evaluate a model (see flexhstu train --help)", add_help=False)
    train.set_defaults(fn=lambda a: _train_main(a.rest))

    args, rest = parser.parse_known_args(argv)
    if args.command not in ("bench", "train") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.command in ("bench", "train"):
        return args.fn(args)
    return run(f"flexhstu {args.command}", lambda: args.fn(args), args.debug)


def _train_main(rest: list[str]) -> int:
    from .. import train

    return train.cli(rest)


def _bench_main(rest: list[str]) -> int:
    from .. import bench

    return bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
