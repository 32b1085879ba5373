"""gym-bridge: rollouts for LLM RL training loops and agent evaluations, over NeMo-Gym or natively.

The contract types are re-exported here lazily, so that ``import gym_bridge``
(and the CLI) does not pay for importing torch until a type is used.
"""

from typing import Any

__version__ = "0.1.0"

_TYPES = (
    "Completion",
    "DatumSpec",
    "EnvironmentReturn",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationOutputSpec",
    "MessageEntry",
    "PromptGroupRecord",
)

__all__ = [*_TYPES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _TYPES:
        from gym_bridge import types

        return getattr(types, name)
    raise AttributeError(f"module 'gym_bridge' has no attribute {name!r}")
