"""How the commands answer a user's mistake: one line ``flexhstu <command>: error: ...``, exit status 2.

Only mistakes in the input become that line: argparse errors, and ``ValueError``/``TypeError``/``OSError``
raised inside a ``user_input()`` block (the steps that validate what the user gave: parsing, the data
file, the checkpoint, the device, the mask arguments). Anything raised elsewhere is a bug and keeps
its traceback; ``--debug`` shows the traceback of a user error too.

A run that cannot finish for a reason outside the input's form (training diverged, a file could not be written)
raises ``RunFailure``: one line ``flexhstu <command>: error: ...`` as well, exit status 1.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class UserError(Exception):
    """A mistake in the command's input; its message is the whole answer."""


class RunFailure(Exception):
    """The command could not finish (training diverged, the disk is full); its message is the whole answer, and
    it says what was kept."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) with exit status 2, whose ``--help``
    shows every option's default after its sentence, and which takes options by their whole names only (an
    abbreviation that works today would change meaning or fail once an option with the same prefix is added)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


@contextmanager
def user_input(arg: str | None = None, lib_arg: str | None = None) -> Iterator[None]:
    """Marks a validation step: its ValueError, TypeError and OSError are the user's mistake. ``arg`` names the
    argument the step reads, for errors (such as a file that cannot be written) that do not name it;
    ``lib_arg``: the library's name for it, replaced by ``arg`` where an error starts with it."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        text = f"{e.strerror}: '{e.filename}'" if isinstance(e, OSError) and e.strerror else str(e)
        if arg and lib_arg and text.startswith(f"{lib_arg}:"):
            text = arg + text[len(lib_arg) :]
        named = arg and not text.startswith(f"{arg}:")  # a message that names the argument already keeps its form
        raise UserError(f"{arg}: {text}" if named else text) from e


@contextmanager
def output_files() -> Iterator[None]:
    """Marks the writing of files the user keeps (checkpoints, metrics): an OSError there (a full disk, a file-size
    limit, a folder made read-only) ends the command with one line naming the file and the system's error. They
    are written atomically (``checkpoint.write_atomic``), so the previous file is still there, whole."""
    try:
        yield
    except OSError as e:
        code = f" ({errno.errorcode[e.errno]})" if e.errno in errno.errorcode else ""
        if e.filename:
            name = Path(e.filename).name
            raise RunFailure(
                f"could not write {e.filename}: {e.strerror}{code}; the previous {name}, if any, is kept whole"
            ) from e
        raise RunFailure(f"could not write {e}") from e


def run(prog: str, fn: Callable[[], int], debug: bool) -> int:
    """``fn()``, with a ``UserError`` turned into one line on stderr and exit status 2, a ``RunFailure`` into one
    line and exit status 1 (both re-raised with ``debug``)."""
    try:
        return fn()
    except (UserError, RunFailure) as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1
    except KeyboardInterrupt:  # Ctrl-C: one line (files a user keeps are written atomically: none is half done)
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


INT64_MAX = 2**63 - 1
SEED_MAX = 2**53 - 1
"""The largest ``--seed``: training seeds its generators with ``seed * 1000 + epoch``, which torch takes below
2^64; 2^53 - 1 leaves room for any epoch count."""


def seed_int(text: str) -> int:
    """argparse type: a seed from 0 to ``SEED_MAX``."""
    value = _int_at_least(text, 0)
    if value > SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2^53 - 1, got {value}")
    return value


def _int_at_least(text: str, low: int) -> int:
    """An int from ``low`` to ``INT64_MAX``: every count, size and id goes into int64 tensors and arrays, where a
    larger one overflowed (``Overflow when unpacking long long``) or turned float (``got double``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got '{text}'") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    if value > INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer from {low} to 2^63 - 1 (int64), got {value}")
    return value


def lengths_list(text: str) -> list[int]:
    """argparse type: comma-separated non-negative integers, e.g. ``40,64``."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got '{text}'")
    return [non_negative_int(x) for x in parts]


def checked_device(text) -> torch.device:
    """``--device`` as a torch.device that the commands run on here: ``cpu``, or ``cuda[:N]`` with CUDA available
    and N below the device count (no side effect: the current CUDA device is left alone)."""
    import torch  # here: the commands' parsers load without it

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device: expected cpu or cuda[:N], got '{text}'") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda[:N] (the kernels and models run on those), got '{text}'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device: expected cpu (CUDA is not available here), got '{text}'")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device: expected cuda:0 to cuda:{count - 1} (this machine has {count}), got '{text}'")
    return device
