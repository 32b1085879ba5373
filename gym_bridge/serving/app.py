"""FastAPI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``, ``/detokenize``, ``/v1/models``,
``/health``, ``/metrics``.

Each route is a module-level handler that reads the :class:`~gym_bridge.serving.state.ServingState` from
``request.app.state``; :func:`build_app` only creates the app and registers the routes and the exception handlers.
Bodies are read by :mod:`~gym_bridge.serving.bodies`, answers built by :mod:`~gym_bridge.serving.responses`, and
``/metrics`` is :mod:`~gym_bridge.serving.metrics`. A request whose client disconnects before its answer is
cancelled (:mod:`~gym_bridge.serving.disconnect`), and with it the engine's rows for it.

Bodies are parsed by hand (time and size limits, JSON, nesting depth, clean strings and numbers, pydantic) so
every refusal is a 4xx with the OpenAI error shape, never FastAPI's 422 or a 500; an exception no route meant is
a 500 with the same shape and one log line (:mod:`~gym_bridge.serving.crashes`). Request bodies are untrusted: the work
that grows with a body (parsing, tokenizing, chat rendering, building the answer) runs in worker threads
(``asyncio.to_thread``; chats render on the render pool of :mod:`~gym_bridge.boundary.chat_template`), never on
the event loop, so one large request does not hold ``/health`` or any other request; stop strings are capped as
vLLM caps them. A failure of an HTTP generation backend keeps its upstream status (a 429 stays a 429, a
context-length 400 stays a 400 naming the context length); an unreachable upstream is a 503 and a malformed
upstream answer a 500.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gym_bridge.boundary.chat_template import off_the_loop
from gym_bridge.failures import EngineShutDownError, GenerationUnavailable, RolloutDataFailure, SettingError
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.serving.bodies import parse_request
from gym_bridge.serving.chat import ChatPrompt, build_chat_prompt
from gym_bridge.serving.crashes import AnswerCrashes, json_response
from gym_bridge.serving.disconnect import CancelOnDisconnect
from gym_bridge.serving.engine import (
    Sample,
    SamplingOverrides,
    effective_top_k,
    generate_rows,
    max_tokens_for,
    resolve_greedy,
)
from gym_bridge.serving.errors import ServingError, error_body
from gym_bridge.serving.metrics import metrics
from gym_bridge.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from gym_bridge.serving.responses import (
    chat_choice,
    completion_choice,
    response_body,
    usage_of,
    with_weight_version,
)
from gym_bridge.serving.state import (
    AUTO_TOOL_CHOICE_REFUSED,
    ServingState,
    serving_state,
)


def build_app(state: ServingState) -> FastAPI:
    """The FastAPI app serving ``state``: its routes, and the handler and middleware that turn errors into
    OpenAI-shaped bodies (a crash inside the disconnect watch, so its 500 counts as the answer)."""
    app = FastAPI(title="gym-bridge OpenAI-compatible server", docs_url=None, redoc_url=None)
    app.state.serving = state
    app.add_middleware(AnswerCrashes)
    app.add_middleware(CancelOnDisconnect)
    app.exception_handler(ServingError)(refused)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    return app


# ---------------------------------------------------------------------- exception handlers


#: Refusals sent before the body was read to its end: the connection closes, so its unread rest is never taken as
#: the next request.
CLOSE_AFTER = frozenset({408, 413})


async def refused(request: Request, exc: ServingError) -> Response:
    """A refusal the server raised on purpose: its status and the OpenAI error body."""
    headers = {"connection": "close"} if exc.status in CLOSE_AFTER else None
    return json_response(error_body(exc.message, exc.status, param=exc.param), exc.status, headers)


# ---------------------------------------------------------------------- routes


async def health() -> dict[str, str]:
    """``GET /health``: always ok while the server answers."""
    return {"status": "ok"}


async def models(request: Request) -> JsonObject:
    """``GET /v1/models``: one card per name the model is served under."""
    state = serving_state(request)
    now = int(time.time())
    cards = [
        {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "gym-bridge",
            "root": state.model_path,
            "max_model_len": state.profile.max_model_len,
        }
        for name in dict.fromkeys(state.model_names)
    ]
    return {"object": "list", "data": cards}


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``: render the chat (carried token ids spliced in), generate ``n`` choices."""
    state = serving_state(request)
    req = await parse_request(request, ChatCompletionRequest, state)
    state.drift.count_request("chat_completions")
    _check_chat(req, state)
    prompt = await off_the_loop(_render_chat, req, req.messages, state)
    headers = state.drift.record(prompt)
    samples = await _generate(
        state, req, prompt.token_ids, req.requested_max_tokens(), clamp=state.features.clamp_max_tokens
    )
    choices = await asyncio.to_thread(_chat_choices, state, req, prompt, samples)
    usage = usage_of(len(prompt.token_ids), samples)
    body = response_body("chatcmpl", "chat.completion", req.model, state, choices, usage)
    if req.return_token_ids and state.features.token_ids:
        body["prompt_token_ids"] = prompt.token_ids
    return await _json_response(body, with_weight_version(body, samples, headers))


def _chat_choices(
    state: ServingState, req: ChatCompletionRequest, prompt: ChatPrompt, samples: list[Sample]
) -> list[JsonObject]:
    """Every choice of a chat answer (decoding and parsing: run in a worker thread)."""
    return [chat_choice(state, req, prompt, index, sample) for index, sample in enumerate(samples)]


async def completions(request: Request) -> Response:
    """``POST /v1/completions``: ``n`` choices for each text or token-id prompt, numbered across prompts."""
    state = serving_state(request)
    req = await parse_request(request, CompletionRequest, state)
    state.drift.count_request("completions")
    _check_common(req, state)
    if req.echo:
        raise ServingError("echo is not supported", param="echo")
    choices: list[JsonObject] = []
    all_samples: list[Sample] = []
    prompt_tokens = 0
    for prompt_ids in await asyncio.to_thread(_completion_prompts, req, state):
        samples = await _generate(state, req, prompt_ids, req.max_tokens)
        prompt_tokens += len(prompt_ids)
        all_samples.extend(samples)
        choices += await asyncio.to_thread(_completion_choices, state, req, prompt_ids, len(choices), samples)
    body = response_body("cmpl", "text_completion", req.model, state, choices, usage_of(prompt_tokens, all_samples))
    return await _json_response(body, with_weight_version(body, all_samples, {}))


def _completion_choices(
    state: ServingState, req: CompletionRequest, prompt_ids: list[int], first: int, samples: list[Sample]
) -> list[JsonObject]:
    """The choices of one prompt, numbered from ``first`` (decoding: run in a worker thread)."""
    return [completion_choice(state, req, prompt_ids, first + k, sample) for k, sample in enumerate(samples)]


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: the token ids of a text ``prompt``, or of ``messages`` rendered as chat completions does."""
    state = serving_state(request)
    req = await parse_request(request, TokenizeRequest, state)
    _check_model(req.model, state)
    tokens = await off_the_loop(_tokenize_ids, req, state)  # a chat renders here
    return await _json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.profile.max_model_len})


def _tokenize_ids(req: TokenizeRequest, state: ServingState) -> list[int]:
    """The ids of a ``/tokenize`` request's prompt or chat (run in a worker thread: a body may hold megabytes)."""
    if req.messages is not None and req.prompt is None:
        return _tokenize_chat(req, state)
    if req.prompt is not None and req.messages is None:
        return list(state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    raise ServingError("send exactly one of 'prompt' or 'messages'")


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: the text of token ids, special tokens kept."""
    state = serving_state(request)
    req = await parse_request(request, DetokenizeRequest, state)
    _check_model(req.model, state)
    return await _json_response({"prompt": await asyncio.to_thread(_detokenize_text, req.tokens, state)})


async def _json_response(body: JsonObject, headers: dict[str, str] | None = None) -> Response:
    """``body`` as a JSON response, encoded in a worker thread (a ``/tokenize`` answer may hold millions of ids)."""
    content = await asyncio.to_thread(_json_bytes, body)
    return Response(content, media_type="application/json", headers=headers)


def _json_bytes(body: JsonObject) -> bytes:
    """Compact UTF-8 JSON, as Starlette's ``JSONResponse`` renders it."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _detokenize_text(ids: list[int], state: ServingState) -> str:
    """The text of ``ids``, checked against the vocabulary (run in a worker thread)."""
    _check_vocab(ids, state)
    return state.tokenizer.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------- request checks


def _check_model(name: str | None, state: ServingState) -> None:
    if name is not None and name not in state.model_names:
        raise ServingError(f"The model `{name}` does not exist; this server serves {state.served_model_name!r}", 404)


def _check_common(req: SamplingFields, state: ServingState) -> None:
    _check_model(req.model, state)
    if req.stream:
        raise ServingError("stream=true is not supported by this server", param="stream")
    if req.n > state.limits.max_n:
        raise ServingError(f"n must be at most {state.limits.max_n}, got {req.n}", param="n")
    stops = 1 if isinstance(req.stop, str) else len(req.stop or ())
    if stops > state.limits.max_stop_strings:
        raise ServingError(
            f"stop holds {stops} strings; at most {state.limits.max_stop_strings} are allowed", param="stop"
        )


def _check_chat(req: ChatCompletionRequest, state: ServingState) -> None:
    """The common checks, then what a chat asks of the server's features: tools, top logprobs."""
    _check_common(req, state)
    if req.tools and req.tool_choice in (None, "auto") and not state.features.auto_tool_choice:
        raise ServingError(AUTO_TOOL_CHOICE_REFUSED)
    if req.top_logprobs:
        raise ServingError(
            "top_logprobs > 0 is not supported: the engine reports only the sampled token's logprob",
            param="top_logprobs",
        )


def _check_vocab(ids: list[int], state: ServingState) -> None:
    if any(t < 0 or t >= state.vocab_size for t in ids):
        raise ServingError(f"token ids must lie in [0, {state.vocab_size})")


def _tokenize_chat(req: TokenizeRequest, state: ServingState) -> list[int]:
    """The chat of a ``/tokenize`` request rendered exactly as chat completions renders it."""
    if not req.messages:
        raise ServingError("messages must not be empty", param="messages")
    return _render_chat(req, req.messages, state, add_generation_prompt=req.add_generation_prompt).token_ids


def _render_chat(
    req: ChatCompletionRequest | TokenizeRequest,
    messages: Sequence[JsonMapping],
    state: ServingState,
    *,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """The one way a request's chat becomes token ids: the server's tokenizer, its splice setting and vocabulary."""
    return build_chat_prompt(
        state.tokenizer,
        messages,
        tools=req.tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs={**state.default_chat_template_kwargs, **(req.chat_template_kwargs or {})},
        required_prefix_token_ids=req.required_prefix_token_ids,
        vocab_size=state.vocab_size,
        splice=state.token_id_correction,
    )


def _completion_prompts(req: CompletionRequest, state: ServingState) -> list[list[int]]:
    """The token ids of every prompt of a completions request, each checked against the vocabulary."""
    items = _prompt_items(req.prompt)
    if not items or len(items) > state.limits.max_prompts:
        raise ServingError(f"prompt must hold 1 to {state.limits.max_prompts} prompts", param="prompt")
    out = []
    for item in items:
        ids = (
            list(state.tokenizer.encode(item, add_special_tokens=req.add_special_tokens))
            if isinstance(item, str)
            else list(item)
        )
        if not ids:
            raise ServingError("a prompt must not be empty", param="prompt")
        _check_vocab(ids, state)
        out.append(ids)
    return out


def _prompt_items(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completions ``prompt`` as a list of prompts: one text, one list of ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    ids = [t for t in prompt if isinstance(t, int)]
    if prompt and len(ids) == len(prompt):
        return [ids]
    return [item for item in prompt if not isinstance(item, int)]


# ---------------------------------------------------------------------- generation


async def _generate(
    state: ServingState, req: SamplingFields, prompt_ids: list[int], requested: int | None, *, clamp: bool = False
) -> list[Sample]:
    """``req.n`` samples of one prompt; an engine failure becomes a refusal with the status it carries (sampling the
    engine refuses for a row is the request's: a 400)."""
    greedy = resolve_greedy(req, state.profile, vocab_size=state.vocab_size)
    max_tokens = max_tokens_for(requested, len(prompt_ids), state.profile, clamp=clamp)
    top_k = effective_top_k(req.top_k, state.vocab_size)
    sampling: SamplingOverrides | None = (
        {"temperature": req.temperature, "top_p": req.top_p, "top_k": top_k, "seed": req.seed}
        if state.profile.per_request_sampling
        else None
    )
    state.rows_generating += req.n
    try:
        return await generate_rows(
            state.generation,
            prompt_ids,
            req.n,
            greedy=greedy,
            stop=req.stop_strings(),
            max_tokens=max_tokens,
            sampling=sampling,
        )
    except GenerationUnavailable as exc:
        status = exc.http_status or 503
        state.drift.count_error(status)
        raise ServingError(f"upstream generation failed: {exc}", status) from exc
    except RolloutDataFailure as exc:
        status = exc.http_status or 500  # a malformed answer: not worth a client retry loop
        state.drift.count_error(status)
        raise ServingError(f"upstream generation failed: {exc}", status) from exc
    except EngineShutDownError as exc:
        raise ServingError(f"the generation engine is not available: {exc}", 503) from exc
    except SettingError as exc:
        raise ServingError(f"the engine refuses this request's sampling: {exc}") from exc
    finally:
        state.rows_generating -= req.n
