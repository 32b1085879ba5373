"""The parser of the ``gym-bridge`` command and its option types: a refused option is one line, exit code 2."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from gym_bridge.boundary.text import shown

MAX_SEED = 2**32 - 1
MAX_TOKENS = 1 << 20


class CommandParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, ``gym-bridge <command>: <message>``, with exit code 2, as every
    other refused input is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {shown(message)} (see {self.prog} --help)\n")


def number(kind: type[int] | type[float], low: float, high: float, ends: str = "[]") -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` from ``low`` to ``high`` (``ends``: ``[`` or ``(`` and ``]`` or ``)``
    say whether each end is allowed); anything else is refused naming the range, before anything starts."""
    what = "an integer" if kind is int else "a finite number"
    span = f"{ends[0]}{low:g}, {high:g}{ends[1]}" if kind is float else f"{ends[0]}{low}, {high}{ends[1]}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            value = math.nan
        above = value > low if ends[0] == "(" else value >= low
        below = value < high if ends[1] == ")" else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be {what} in {span}, got {shown(text[:40])!r}")
        return value

    return parse
