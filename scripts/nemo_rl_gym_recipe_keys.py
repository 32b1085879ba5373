"""Write tests/data/nemo_rl_gym_recipe_keys.yaml: every key NeMo-RL's Gym recipes set, with the values they set.

Usage: uv run python scripts/nemo_rl_gym_recipe_keys.py /path/to/NeMo-RL [--commit SHA] [--out PATH]

A Gym recipe is a YAML under ``examples/`` whose ``env.should_use_nemo_gym`` is true once its ``defaults:``
parents are merged (NeMo-RL's loader rules, :func:`gym_bridge.config.training.load_training_config`). Each
leaf key of every such recipe is listed with the distinct values the recipes give it, in the order first
seen. An ``${oc.env:VAR}`` whose variable is unset becomes the string ``<$VAR>``. The key-walk test
(``tests/config/test_nemo_rl_keys.py``) reads the fixture, so CI needs no NeMo-RL checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from gym_bridge.config.loading import _load_with_defaults, _register_resolvers

_MISSING_ENV = re.compile(r"Environment variable '([^']+)' not found")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "nemo_rl_gym_recipe_keys.yaml"


def _resolved(node: Any) -> Any:
    """The recipe as plain containers, with unset ``oc.env`` variables stood in by ``<$VAR>``."""
    stood_in: list[str] = []
    try:
        while True:
            try:
                return OmegaConf.to_container(node, resolve=True)
            except Exception as exc:  # OmegaConf wraps the KeyError of a missing variable
                missing = _MISSING_ENV.search(str(exc))
                if missing is None or missing.group(1) in stood_in:
                    raise
                stood_in.append(missing.group(1))
                os.environ[missing.group(1)] = f"<${missing.group(1)}>"
    finally:
        for name in stood_in:
            os.environ.pop(name, None)


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}.{key}" if prefix else key)]
    return [(prefix, node)]


def collect(root: Path) -> tuple[list[str], dict[str, list[Any]]]:
    """The Gym recipes (paths relative to ``root``) and ``{key: [values]}`` over all of them."""
    _register_resolvers()
    recipes: list[str] = []
    values: dict[str, list[Any]] = {}
    for path in sorted((root / "examples").rglob("*.yaml")):
        node = _load_with_defaults(path)
        if OmegaConf.select(node, "env.should_use_nemo_gym", default=None) is not True:
            continue
        recipes.append(str(path.relative_to(root)))
        for key, value in _leaves(_resolved(node)):
            seen = values.setdefault(key, [])
            if all(json.dumps(value, sort_keys=True) != json.dumps(v, sort_keys=True) for v in seen):
                seen.append(value)
    return recipes, dict(sorted(values.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nemo_rl", type=Path, help="a NeMo-RL checkout")
    parser.add_argument("--commit", help="the checkout's commit (default: git rev-parse --short HEAD)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    commit = (
        args.commit
        or subprocess.run(
            ["git", "-C", str(args.nemo_rl), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    recipes, values = collect(args.nemo_rl)
    under_recipes = sum(r.startswith("examples/configs/recipes/") for r in recipes)
    header = (
        f"# Written by scripts/nemo_rl_gym_recipe_keys.py from NeMo-RL {commit}; regenerate, do not edit.\n"
        f"# {len(recipes)} YAMLs set env.should_use_nemo_gym: true once their defaults are merged "
        f"({under_recipes} under examples/configs/recipes/); {len(values)} keys.\n"
    )
    body = {"nemo_rl_commit": commit, "recipes": recipes, "keys": values}
    args.out.write_text(header + yaml.safe_dump(body, sort_keys=False, width=120))
    print(f"{args.out}: {len(recipes)} recipes, {len(values)} keys")


if __name__ == "__main__":
    main()
