"""gym-bridge: rollouts for LLM RL training loops and agent evaluations, over NeMo-Gym or natively."""

from gym_bridge.types import (
    Completion,
    DatumSpec,
    EnvironmentReturn,
    GenerationConfig,
    GenerationDatumSpec,
    GenerationOutputSpec,
    MessageEntry,
    PromptGroupRecord,
)

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "DatumSpec",
    "EnvironmentReturn",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationOutputSpec",
    "MessageEntry",
    "PromptGroupRecord",
    "__version__",
]
