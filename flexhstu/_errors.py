"""One shape for every input error: the argument, what was expected, what was given."""

from __future__ import annotations


def bad_value(arg: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {got}")


def bad_type(arg: str, expected: str, got: object) -> TypeError:
    return TypeError(f"{arg}: expected {expected}, got {got}")
