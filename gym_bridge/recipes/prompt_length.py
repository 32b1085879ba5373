"""How long a Gym row's first prompt is under a model's chat template, read in seconds before anything starts: the
model's tokenizer and own context (:func:`model_facts`) and the longest first prompt of a set of rows
(:func:`longest_prompt`), rendered as Gym's ``vllm_model`` sends it, tools included."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from gym_bridge.json_types import JsonMapping

logger = logging.getLogger(__name__)

RENDERED_ROWS = 32
"""How many rows of a file are rendered through the chat template: the longest by characters (the chat and its
tools), so a dataset of thousands of rows with dozens of tools each is checked in seconds."""


@dataclass(frozen=True)
class ModelFacts:
    """The model's tokenizer and own context (``max_position_embeddings``; None when its config has none)."""

    name: str
    tokenizer: Any
    context: int | None


@lru_cache(maxsize=4)
def model_facts(name: str) -> ModelFacts | None:
    """The tokenizer and context of ``name`` (a built-in model, built on first use, or a local folder); None when it
    names neither (``grpo_run_settings`` names ``policy.model_name``) or its tokenizer does not load."""
    from gym_bridge.models.registry import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(name)
    except ModelNotFoundError:
        return None
    from gym_bridge.models.folder_check import load_tokenizer, model_config

    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        logger.debug("early checks: no tokenizer from %s (%s)", path, exc)
        return None
    context = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        context = int(model_config(path)["max_position_embeddings"])
    return ModelFacts(name, tokenizer, context)


def first_prompt_tokens(row: object, tokenizer: Any, template_kwargs: JsonMapping | None = None) -> int | None:
    """The tokens of a row's first model call: its Responses input as Gym's ``vllm_model`` turns it into a chat,
    rendered with the tokenizer's chat template, the row's tools and the run's ``template_kwargs`` (the row's own
    over them, as the server merges them); None for a row that does not render."""
    from gym_bridge.gym_model.translate import responses_to_chat
    from gym_bridge.serving.chat import build_chat_prompt

    params = row.get("responses_create_params") if isinstance(row, Mapping) else None
    if not isinstance(params, dict):
        return None
    try:
        turn = responses_to_chat(params, uses_reasoning_parser=False)
        kwargs = {**(template_kwargs or {}), **turn.chat_template_kwargs}
        prompt = build_chat_prompt(tokenizer, turn.messages, tools=turn.tools, chat_template_kwargs=kwargs or None)
    except Exception as exc:  # a row the template cannot render is named by the rollout that sends it
        logger.debug("early checks: a row does not render (%s)", exc)
        return None
    return len(prompt.token_ids)


@dataclass(frozen=True)
class LongestPrompt:
    tokens: int
    where: str
    """``<key> (<file>) row <n>``."""


class NamedRows(Protocol):
    """Rows and where they come from (what :func:`longest_prompt` reads: a data file's rows)."""

    @property
    def where(self) -> str: ...

    @property
    def rows(self) -> Sequence[object]: ...


def prompt_chars(row: object) -> int:
    """The characters of a row's first prompt as JSON (input, tools, instructions): an upper bound on its text."""
    params = row.get("responses_create_params") if isinstance(row, Mapping) else None
    if not isinstance(params, Mapping):
        return 0
    return len(json.dumps([params.get("input"), params.get("tools"), params.get("instructions")], default=str))


def longest_prompt(
    files: Iterable[NamedRows],
    tokenizer: Any,
    *,
    rendered: int = RENDERED_ROWS,
    template_kwargs: JsonMapping | None = None,
) -> LongestPrompt | None:
    """The longest first prompt of ``files`` in tokens: each file's ``rendered`` longest rows by characters rendered
    through the chat template (every row when a file has no more)."""
    best: LongestPrompt | None = None
    for file in files:
        ranked = sorted(range(len(file.rows)), key=lambda i: -prompt_chars(file.rows[i]))[:rendered]
        for i in sorted(ranked):
            tokens = first_prompt_tokens(file.rows[i], tokenizer, template_kwargs)
            if tokens is not None and (best is None or tokens > best.tokens):
                best = LongestPrompt(tokens, f"{file.where} row {i}")
    return best
