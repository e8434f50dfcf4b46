"""The command line: pictures and the demo."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from flexhstu.cli.main import main
from flexhstu.masks import picture


def test_show_mask_draws_visible_hidden_and_padding(tmp_path, capsys):
    out = tmp_path / "m.png"
    assert main(["show-mask", "sla", "--lengths", "20,32", "--sla-k1", "4", "--sla-k2", "2", "-o", str(out)]) == 0
    pixels = np.asarray(Image.open(out).convert("RGB")).reshape(-1, 3)
    colours = {tuple(p) for p in pixels}
    assert picture.VISIBLE in colours and picture.HIDDEN in colours and picture.PADDING in colours
    assert "NFUNC 3" in capsys.readouterr().out


def test_show_mask_onerank_needs_targets(tmp_path, capsys):
    assert main(["show-mask", "onerank", "--lengths", "20", "-o", str(tmp_path / "x.png")]) == 2
    assert "--targets: expected one target count per sequence" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_demo_checks_both_backends_against_the_reference_and_writes_pictures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the suite's setting; the demo switches it on itself when it can
    assert main(["demo", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.startswith(("causal", "sla", "onerank"))]
    assert sorted((r[0], r[-6]) for r in rows) == sorted(
        (m, b) for m in ("causal", "sla", "onerank") for b in ("pytorch", "triton")
    )
    for row in rows:
        assert row[-1] == "pass" and float(row[-3]) < 1e-4  # max |err| against the float64 reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask-causal.png", "mask-onerank.png", "mask-sla.png"]


def test_demo_exits_1_when_a_check_fails(tmp_path, capsys, monkeypatch):
    import flexhstu.cli.main as cli_main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setitem(cli_main.TOLERANCE, torch.float32, 0.0)
    monkeypatch.setattr(cli_main, "_triton_on_cpu", lambda: "skipped: for this test")  # the reference alone
    assert main(["demo", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "triton: skipped: for this test" in captured.out
    assert "check(s) failed" in captured.err


def test_demo_says_why_it_skips_triton(monkeypatch):
    import importlib.util
    import sys

    import flexhstu.cli.main as cli_main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or object())
    assert cli_main._triton_on_cpu().startswith("skipped: triton was imported before the interpreter")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert cli_main._triton_on_cpu() == "skipped: triton is not installed (pip install 'flexhstu[gpu]')"


def _option_actions(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_option_of_every_command_has_a_sentence_and_shows_its_default(capsys):
    import argparse

    from flexhstu import train
    from flexhstu.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = [sub.choices["demo"], sub.choices["show-mask"], train.build_parser()]
    for parser in parsers:
        for action in _option_actions(parser):
            assert action.help and len(action.help) > 8, (parser.prog, action.option_strings)
        parser.print_help()
        text = capsys.readouterr().out
        for action in _option_actions(parser):
            if action.default not in (None, False):
                assert f"(default: {action.default})" in " ".join(text.split()), (parser.prog, action.dest)


def test_sla_flags_are_named_alike_in_every_command():
    from flexhstu import train
    from flexhstu.cli.main import build_parser

    show = build_parser().parse_args(["show-mask", "sla", "--lengths", "8", "--sla-k1", "3", "--sla-k2", "1"])
    trained = train.parse(["--mask", "sla", "--sla-k1", "3", "--sla-k2", "1"])
    assert (show.sla_k1, show.sla_k2) == (trained.sla_k1, trained.sla_k2) == (3, 1)
