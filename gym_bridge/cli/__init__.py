"""The ``gym-bridge`` command: :func:`main` parses (:mod:`.parser`), runs the subcommand (:mod:`.commands`) and is the
one error boundary, turning every refused input into one line and exit code 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gym_bridge.boundary.text import shown
from gym_bridge.cli.parser import build_parser

if TYPE_CHECKING:
    import argparse

DEBUG_ENV = "GYM_BRIDGE_DEBUG"
"""Set to 1: an error shows its whole traceback (as ``--traceback`` does)."""
EXIT_BUG = 70
"""The exit code of an error no input explains (a bug in gym-bridge): sysexits' ``EX_SOFTWARE``."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand and return its exit code. The one error boundary: a usage error or an option out of its
    range is one line before anything starts (exit 2, returned, not raised); any
    :class:`~gym_bridge.failures.GymBridgeError` (every error a user's input can cause) and any ``OSError`` (a
    path the system refused) end as ``gym-bridge <command>: <message>`` on stderr, one line per line of the
    message, with exit code 2; Ctrl-C is ``interrupted`` (130). Anything else is a bug: one line that says so, its
    traceback saved to a file (:func:`_bug`), exit code :data:`EXIT_BUG`. ``--traceback`` (or
    ``GYM_BRIDGE_DEBUG=1``) shows the whole traceback instead."""
    try:
        args = _parsed(argv)
    except SystemExit as exc:  # a usage error (2) or --help (0): the code returned, as for every other outcome
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except Exception as exc:
        if args.traceback or os.environ.get(DEBUG_ENV) == "1":
            raise
        code, lines = _explained(exc)
    except KeyboardInterrupt:
        if args.traceback or os.environ.get(DEBUG_ENV) == "1":
            raise
        code, lines = 130, ["interrupted"]
    for line in lines:
        print(f"gym-bridge {args.command}: {shown(line)}", file=sys.stderr)
    return code


def _parsed(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, ``key=value`` overrides after an option included; a usage error exits (argparse)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow an option (``rescore RUN --out DIR key=value``); argparse before Python 3.13
    # stops filling a ``nargs="*"`` positional once an option came between, so they are collected here.
    stray = [arg for arg in extra if arg.startswith("-") or "=" not in arg]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _explained(exc: Exception) -> tuple[int, list[str]]:
    """The exit code and the lines of an error: a refused input (2) in its own words, or a bug (:func:`_bug`)."""
    from gym_bridge.failures import GymBridgeError

    if isinstance(exc, GymBridgeError):
        return 2, str(exc).splitlines() or [type(exc).__name__]
    if isinstance(exc, OSError):
        names = [shown(name) for name in (exc.filename, exc.filename2) if name is not None]
        return 2, [": ".join([*names, shown(exc.strerror or exc)])]
    return EXIT_BUG, [_bug(exc)]


def _bug(exc: Exception) -> str:
    """The one line of an error no input explains, its traceback written to a file in the temporary folder
    (``$TMPDIR``): a run that failed after an hour keeps what a bug report needs without a second run, and the
    terminal and scripts still see one line."""
    import tempfile
    import time
    import traceback
    from pathlib import Path

    from gym_bridge.boundary.files import write_atomic
    from gym_bridge.failures import GymBridgeError

    saved = Path(tempfile.gettempdir()) / f"gym-bridge-traceback-{os.getpid()}-{time.time_ns()}.txt"
    try:
        write_atomic(saved, "".join(traceback.format_exception(exc)))
        where = f"traceback in {shown(saved)}"
    except (OSError, GymBridgeError):
        where = f"run again with --traceback or {DEBUG_ENV}=1 for the traceback"
    message = shown(" ".join(str(exc).split())[:300])
    return f"internal error, please report it: {type(exc).__name__}: {message} ({where})"
