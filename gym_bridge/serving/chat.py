"""Chat rendering and NeMo-RL's on-policy prefix splice.

:func:`build_chat_prompt` is the single place a chat becomes engine token ids; chat
completions and chat ``/tokenize`` both call it, so they agree token for token.

When an earlier assistant message carries ``prompt_token_ids`` + ``generation_token_ids``
(or the request has ``required_prefix_token_ids``), those ids are the model prefix and
the template only supplies the glue after them (:func:`replace_prefix_tokens`): the
tokens the model really generated are kept bit-exact instead of being re-tokenised
from their text.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

from gym_bridge.boundary import json_io
from gym_bridge.boundary.chat_template import DEFAULT_BOUNDS, RenderBounds, TemplateBoundError, render_chat_template
from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.protocol import TOKEN_FIELDS

if TYPE_CHECKING:  # gym_bridge.types imports torch, which the Gym model server does without
    from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "return_dict", "continue_final_message"}
)


@dataclass(frozen=True)
class ChatPrompt:
    """The engine prompt of a chat request.

    ``spliced``: carried ids were used. ``carried``: the request carried ids at all.
    ``drift_at``: where the plain re-tokenised render first differs from the
    carried-ids prompt (None: no drift, or nothing carried) — with the splice on,
    the drift it prevented; with it off, the drift that was served.
    """

    token_ids: list[int]
    spliced: bool
    carried: bool = False
    drift_at: int | None = None


def build_chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[JsonMapping],
    *,
    tools: list[JsonObject] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: JsonMapping | None = None,
    required_prefix_token_ids: list[int] | None = None,
    vocab_size: int | None = None,
    splice: bool = True,
    bounds: RenderBounds = DEFAULT_BOUNDS,
) -> ChatPrompt:
    """Render ``messages`` to token ids, splicing in carried token ids (see module docstring).

    ``splice=False`` serves the plain render as stock vLLM does (carried ids ignored)
    and only measures the drift. Every render runs within ``bounds``.
    """
    clean = normalize_messages(messages)
    template = render_ids(tokenizer, clean, tools, add_generation_prompt, chat_template_kwargs, bounds)
    prefix_index, model_prefix = _model_prefix(messages, required_prefix_token_ids)
    if not model_prefix:
        return ChatPrompt(template, spliced=False)
    if not splice:
        try:
            corrected = _splice(
                tokenizer, clean, tools, chat_template_kwargs, template, prefix_index, model_prefix, bounds
            )
        except ServingError:  # nothing to compare against; the plain render is served anyway
            return ChatPrompt(template, spliced=False, carried=True)
        return ChatPrompt(template, spliced=False, carried=True, drift_at=first_difference(template, corrected))
    _check_ids(model_prefix, vocab_size, "carried prompt/generation token ids")
    spliced = _splice(tokenizer, clean, tools, chat_template_kwargs, template, prefix_index, model_prefix, bounds)
    return ChatPrompt(spliced, spliced=True, carried=True, drift_at=first_difference(template, spliced))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), or None if equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _splice(
    tokenizer: Tokenizer,
    clean: list[JsonObject],
    tools: list[JsonObject] | None,
    chat_template_kwargs: JsonMapping | None,
    template: list[int],
    prefix_index: int | None,
    model_prefix: list[int],
    bounds: RenderBounds,
) -> list[int]:
    upto = prefix_index + 1 if prefix_index is not None else _last_assistant_end(clean)
    template_prefix = render_ids(tokenizer, clean[:upto], tools, False, chat_template_kwargs, bounds)
    return replace_prefix_tokens(tokenizer, model_prefix, template_prefix, template)


def replace_prefix_tokens(
    tokenizer: Tokenizer, model_prefix: list[int], template_prefix: list[int], template: list[int]
) -> list[int]:
    """Keep ``model_prefix`` bit-exact and append what ``template`` has after the same turn.

    The turn boundary is found by counting EOS tokens: ``template_prefix`` (the render up
    to and including the prefix's last assistant message, no generation prompt) holds
    ``k`` EOS tokens, so the boundary in ``template`` is its ``k``-th EOS. The model
    prefix's own trailing EOS, if any, is dropped: the template's EOS at the boundary
    replaces it (a turn that stopped for length gets one, as the template would add).
    """
    if not model_prefix:
        return list(template)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ServingError("cannot splice carried token ids: the tokenizer has no EOS token")
    cut = len(model_prefix) - 1 if model_prefix[-1] == eos else len(model_prefix)
    wanted = sum(1 for t in template_prefix if t == eos)
    if wanted == 0:
        raise ServingError("cannot splice carried token ids: the rendered prefix holds no EOS token")
    seen = 0
    for pos, tok in enumerate(template):
        if tok == eos:
            seen += 1
            if seen == wanted:
                return list(model_prefix[:cut]) + list(template[pos:])
    raise ServingError(
        f"cannot splice carried token ids: the rendered chat has {seen} EOS tokens but the prefix up to the "
        f"carrying assistant message has {wanted} (prefix ends {tokenizer.decode(template_prefix[-20:])!r}, "
        f"chat ends {tokenizer.decode(template[-20:])!r})"
    )


def render_ids(
    tokenizer: Tokenizer,
    messages: list[JsonObject],
    tools: list[JsonObject] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: JsonMapping | None,
    bounds: RenderBounds = DEFAULT_BOUNDS,
) -> list[int]:
    """Render the chat template to text as ``apply_chat_template`` does, in the bounded sandbox
    (:mod:`~gym_bridge.boundary.chat_template`), then tokenize it without adding special tokens (as vLLM does).

    A template past its bound is a 400, as a template's other failures are: the same request fails the same way
    every time, and OpenAI clients retry a 5xx, which would run the runaway template again for each retry.
    """
    kwargs = dict(chat_template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise ServingError(f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs")
    try:
        text = render_chat_template(
            tokenizer,
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=kwargs,
            bounds=bounds,
        )
    except TemplateBoundError as exc:
        raise ServingError(f"{exc}; this request is refused, the server keeps serving") from None
    except Exception as exc:  # jinja errors and raise_exception() in templates are the client's
        raise ServingError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def normalize_messages(messages: Sequence[JsonMapping]) -> list[JsonObject]:
    """Validate roles, drop the carried token fields, and parse tool-call arguments to objects (as vLLM does)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ServingError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        clean = {k: copy.deepcopy(v) for k, v in message.items() if k not in TOKEN_FIELDS}
        content = clean.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ServingError(f"messages[{i}].content must be a string, a list of parts or null", param="messages")
        calls = clean.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ServingError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ServingError(f"messages[{i}].tool_calls entries need function.name", param="messages")
            args = fn.get("arguments")
            if isinstance(args, str):
                parsed = parse_arguments(args, f"messages[{i}].tool_calls[{j}].function.arguments")
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
        out.append(clean)
    return out


def parse_arguments(text: str, where: str) -> object:
    """A tool call's ``arguments`` string as JSON (through the boundary's decoder); None when it is not JSON (it is
    then rendered as the string it is, as before). Nested past the boundary's depth limit it is a 400 naming
    ``where``: the template and the splice copy and walk it, one level at a time."""
    if not text.strip():
        return {}
    try:
        return json_io.loads(text, where)
    except UntrustedInputError as exc:
        if json_io.raw_depth(text.encode("utf-8", "surrogatepass")) > json_io.MAX_DEPTH:
            raise ServingError(f"{where} nests deeper than {json_io.MAX_DEPTH} levels", param=where) from None
        logger.debug("tool-call arguments are not JSON, rendered as text (%s)", exc)
        return None


def _model_prefix(messages: Sequence[JsonMapping], required: list[int] | None) -> tuple[int | None, list[int]]:
    """(index of the carrying message or None, prefix ids); explicit ``required`` ids win."""
    if required:
        return None, list(required)
    for i in range(len(messages) - 1, -1, -1):
        prompt = messages[i].get("prompt_token_ids")
        generated = messages[i].get("generation_token_ids")
        if prompt is None and generated is None:
            continue
        if not _is_id_list(prompt) or not _is_id_list(generated):
            raise ServingError(
                f"messages[{i}] must carry prompt_token_ids and generation_token_ids as lists of ints", param="messages"
            )
        return i, list(prompt) + list(generated)
    return None, []


def _last_assistant_end(messages: list[JsonObject]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return i + 1
    raise ServingError("required_prefix_token_ids needs an assistant message to splice after")


def _is_id_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_ids(ids: list[int], vocab_size: int | None, what: str) -> None:
    if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
        raise ServingError(f"{what} hold ids outside the vocabulary [0, {vocab_size})")
