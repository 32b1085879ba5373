"""The chat-template arguments every prompt of a run renders with, from NeMo-RL's two keys for them, as one mapping.

NeMo-RL applies ``policy.tokenizer.chat_template_kwargs`` to its tokenizer's ``apply_chat_template``, and its vLLM
server renders Gym's prompts with ``policy.generation.vllm_cfg.http_server_serving_chat_kwargs`` 's
``default_chat_template_kwargs`` (or, when that is unset, the older spelling ``chat_template_kwargs``), under a
request's own keys. gym-bridge renders a prompt in several places (its server, Gym's model server path, the early
checks of prompt length), so :func:`chat_template_kwargs` merges both keys into one mapping that each of them uses: the
server's keys over the tokenizer's, and a request's own over both, as vLLM merges them. A recipe that sets only the
tokenizer's key gets it on Gym's prompts too, so the ids the trainer scores are those the template gives with it.

A chat template of the recipe's own (``policy.tokenizer.chat_template``, the server's ``chat_template``) is refused:
the server renders with the model folder's template.
"""

from __future__ import annotations

from gym_bridge.config.keys import TrainingConfigError, config_value
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.serving.chat import RESERVED_TEMPLATE_KWARGS

TOKENIZER_KEY = "policy.tokenizer.chat_template_kwargs"
SERVING_SECTION = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs"
SERVING_KEYS = (f"{SERVING_SECTION}.default_chat_template_kwargs", f"{SERVING_SECTION}.chat_template_kwargs")
"""vLLM's spelling first; the older one is read only when the first is unset (NeMo-RL's ``vllm_worker_async``)."""
TEMPLATE_KEYS = ("policy.tokenizer.chat_template", f"{SERVING_SECTION}.chat_template")
"""A chat template of the recipe's own: not implemented (the model folder's template renders every prompt)."""


def chat_template_kwargs(config: JsonMapping) -> JsonObject:
    """The run's chat-template arguments: :data:`TOKENIZER_KEY`, then the first set of :data:`SERVING_KEYS` over it;
    a value that is not a mapping of names, or that sets an argument the render itself passes, is refused by key."""
    merged: JsonObject = dict(_mapping(config, TOKENIZER_KEY))
    for key in SERVING_KEYS:
        if config_value(config, key, None) is not None:
            merged.update(_mapping(config, key))
            break
    return merged


def _mapping(config: JsonMapping, key: str) -> JsonObject:
    value = config_value(config, key, None)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
        raise TrainingConfigError(f"{key} must be a mapping of argument names to values, got {value!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if reserved:
        raise TrainingConfigError(f"{key} may not set {reserved}: the render passes them itself")
    return dict(value)
