"""An OpenAI-compatible HTTP server (vLLM's dialect, NeMo-RL's extensions) over any GenerationInterface.

The names below are imported on first use, so a process that needs only the chat
render or the parsers (gym-bridge's Gym model server) does not import torch or FastAPI.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AUTO_TOOL_CHOICE_REFUSED": "gym_bridge.serving.state",
    "ApiKeyMiddleware": "gym_bridge.serving.auth",
    "DriftCounter": "gym_bridge.serving.drift",
    "OpenAIServer": "gym_bridge.serving.server",
    "ServerFeatures": "gym_bridge.serving.state",
    "ServerLimits": "gym_bridge.serving.state",
    "ServingError": "gym_bridge.serving.errors",
    "build_chat_prompt": "gym_bridge.serving.chat",
    "build_proxy": "gym_bridge.serving.upstream",
    "parse_reasoning": "gym_bridge.serving.parsers",
    "parse_tool_calls": "gym_bridge.serving.parsers",
    "replace_prefix_tokens": "gym_bridge.serving.chat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gym_bridge.serving' has no attribute {name!r}")
