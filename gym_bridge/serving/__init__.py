"""An OpenAI-compatible HTTP server (vLLM's dialect, NeMo-RL's extensions) over any GenerationInterface."""

from gym_bridge.serving.app import AUTO_TOOL_CHOICE_REFUSED, ServerFeatures, ServerLimits
from gym_bridge.serving.chat import build_chat_prompt, replace_prefix_tokens
from gym_bridge.serving.drift import DriftCounter
from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.parsers import parse_reasoning, parse_tool_calls
from gym_bridge.serving.server import OpenAIServer
from gym_bridge.serving.upstream import build_proxy

__all__ = [
    "AUTO_TOOL_CHOICE_REFUSED",
    "DriftCounter",
    "OpenAIServer",
    "ServerFeatures",
    "ServerLimits",
    "ServingError",
    "build_chat_prompt",
    "build_proxy",
    "parse_reasoning",
    "parse_tool_calls",
    "replace_prefix_tokens",
]
