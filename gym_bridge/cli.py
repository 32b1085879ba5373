"""The ``gym-bridge`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _backends(args: argparse.Namespace) -> int:
    from gym_bridge.rollout.registry import available_backends

    for name, entry in available_backends().items():
        print(f"{name:16} {entry.value}  ({entry.distribution})")
    return 0


def _build_tiny(args: argparse.Namespace) -> int:
    from gym_bridge.models.tiny import build_tiny_model

    print(build_tiny_model(cache_dir=args.cache_dir, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gym-bridge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("backends", help="list the registered rollout backends").set_defaults(func=_backends)
    tiny = commands.add_parser("build-tiny", help="build (or reuse) the embedded tiny model and print its folder")
    tiny.add_argument("--cache-dir", default=None)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_build_tiny)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
