"""gym-bridge: rollouts for LLM RL training loops and agent evaluations, over NeMo-Gym or natively.

The public API is importable from here (``from gym_bridge import RolloutManager, NemoGymConfig``).
:mod:`gym_bridge._public` lists it, one import per name from its defining module. Every name is
resolved lazily on first use (module ``__getattr__``), so ``import gym_bridge`` and the CLI pay
for torch or Ray only when a name that needs them is used.
"""

from __future__ import annotations

import ast
import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gym_bridge._public import *  # noqa: F403  (every public name, for type checkers)


def _read_exports() -> dict[str, str]:
    """Public name -> defining module, read from :mod:`gym_bridge._public`'s imports without running them."""
    with open(os.path.join(os.path.dirname(__file__), "_public.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gym_bridge.")
        for alias in node.names
    }


_EXPORTS: dict[str, str] = _read_exports()
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gym_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
