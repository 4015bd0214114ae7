"""Argument types the management commands share: each names what a bad value should be."""

from __future__ import annotations

import math
from argparse import ArgumentTypeError
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def _checked(
    convert: Callable[[str], N], accepts: Callable[[N], bool], must_be: str
) -> Callable[[str], N]:
    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            pass
        else:
            if accepts(value):
                return value
        raise ArgumentTypeError(f"must be {must_be}, not {text!r}")

    return parse


def whole_number(must_be: str) -> Callable[[str], int]:
    """An argument type for a whole number, 1 or more; a bad value ``must be`` so."""
    return _checked(int, lambda value: value >= 1, must_be)


def number(must_be: str, *, zero: bool = False) -> Callable[[str], float]:
    """An argument type for a finite number above 0 (or 0 too, with ``zero``)."""
    return _checked(
        float, lambda value: math.isfinite(value) and (value >= 0 if zero else value > 0), must_be
    )
