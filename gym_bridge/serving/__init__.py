"""An OpenAI-compatible HTTP server (vLLM's dialect, NeMo-RL's extensions) over any GenerationInterface."""

from gym_bridge.serving.app import ServerLimits
from gym_bridge.serving.chat import build_chat_prompt, replace_prefix_tokens
from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.parsers import parse_reasoning, parse_tool_calls
from gym_bridge.serving.server import OpenAIServer

__all__ = [
    "OpenAIServer",
    "ServerLimits",
    "ServingError",
    "build_chat_prompt",
    "parse_reasoning",
    "parse_tool_calls",
    "replace_prefix_tokens",
]
