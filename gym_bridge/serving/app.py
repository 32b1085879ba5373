"""FastAPI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``, ``/detokenize``, ``/v1/models``,
``/health``, ``/metrics``.

Bodies are parsed by hand (size limit, JSON, pydantic) so every refusal is a 4xx
with the OpenAI error shape, never FastAPI's 422 or a 500. A failure of an HTTP
generation backend keeps its upstream status (a 429 stays a 429, a context-length
400 stays a 400 naming the context length); an unreachable upstream is a 503 and a
malformed upstream answer a 500.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError

from gym_bridge.failures import GenerationUnavailable, RolloutDataFailure
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.serving.chat import build_chat_prompt
from gym_bridge.serving.drift import DriftCounter
from gym_bridge.serving.engine import (
    EngineProfile,
    Sample,
    generate_rows,
    max_tokens_for,
    resolve_greedy,
    weight_version_of,
)
from gym_bridge.serving.errors import ServingError, error_body
from gym_bridge.serving.parsers import parse_assistant_text
from gym_bridge.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)


#: Response header naming the weight version that generated the response (engines with refits only).
WEIGHT_VERSION_HEADER = "x-gym-bridge-weight-version"


@dataclass(frozen=True)
class ServerLimits:
    """Request limits; anything over them is refused with a 4xx."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    max_prompts: int = 64


#: vLLM's exact 400 message for a chat with tools when started without a tool-call parser.
AUTO_TOOL_CHOICE_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ServerFeatures:
    """What the server supports; turning one off makes it answer like a vLLM set up without it
    (for preflight tests and for people who want to see the failure before a run)."""

    auto_tool_choice: bool = True
    """False: a chat offering tools with ``tool_choice`` auto gets vLLM's 400 :data:`AUTO_TOOL_CHOICE_REFUSED`."""
    logprobs: bool = True
    """False: ``logprobs`` is null in every answer, as from a server that does not compute them."""
    token_ids: bool = True
    """False: ``return_token_ids`` and ``return_tokens_as_token_ids`` are ignored and no token-id fields are sent."""
    clamp_max_tokens: bool = False
    """True: a chat's ``max_tokens`` beyond the room its prompt leaves is cut to that room, as NeMo-RL's training
    server does (``vllm_worker_async``); False: vLLM's 400."""


@dataclass
class ServingState:
    generation: GenerationInterface
    tokenizer: Any
    served_model_name: str
    model_path: str
    reasoning_parser: bool
    profile: EngineProfile
    limits: ServerLimits
    vocab_size: int
    token_id_correction: bool = True
    features: ServerFeatures = field(default_factory=ServerFeatures)
    drift: DriftCounter = field(default_factory=DriftCounter)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, self.model_path)


def build_app(state: ServingState) -> FastAPI:
    app = FastAPI(title="gym-bridge OpenAI-compatible server", docs_url=None, redoc_url=None)
    app.state.serving = state

    @app.exception_handler(ServingError)
    async def _refused(request: Request, exc: ServingError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, param=exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _crashed(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request to %s failed", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.drift.prometheus_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        req = await _parse(request, ChatCompletionRequest, state)
        state.drift.count_request("chat_completions")
        _check_common(req, state)
        features = state.features
        if req.tools and req.tool_choice in (None, "auto") and not features.auto_tool_choice:
            raise ServingError(AUTO_TOOL_CHOICE_REFUSED)
        if req.top_logprobs:
            raise ServingError(
                "top_logprobs > 0 is not supported: the engine reports only the sampled token's logprob",
                param="top_logprobs",
            )
        prompt = build_chat_prompt(
            state.tokenizer,
            req.messages,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
            required_prefix_token_ids=req.required_prefix_token_ids,
            vocab_size=state.vocab_size,
            splice=state.token_id_correction,
        )
        headers = state.drift.record(prompt)
        samples = await _generate(
            state, req, prompt.token_ids, req.requested_max_tokens(), clamp=features.clamp_max_tokens
        )
        use_tools = bool(req.tools) and req.tool_choice != "none"
        as_ids = req.return_tokens_as_token_ids is not False and features.token_ids
        token_ids = req.return_token_ids and features.token_ids
        choices = []
        for index, sample in enumerate(samples):
            text = _text(state, sample, req.stop_strings())
            parsed = parse_assistant_text(text, reasoning=state.reasoning_parser, tools=use_tools)
            finish = sample.finish_reason
            if parsed.tool_calls and finish == "stop":
                finish = "tool_calls"
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
            if state.reasoning_parser:
                message["reasoning_content"] = parsed.reasoning_content
            if features.token_ids:
                message["prompt_token_ids"] = prompt.token_ids
                message["generation_token_ids"] = sample.token_ids
                message["generation_log_probs"] = sample.logprobs
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": _chat_logprobs(state, sample, as_ids) if req.logprobs and features.logprobs else None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            if token_ids:
                choice["token_ids"] = sample.token_ids
            if sample.weight_version is not None:
                choice["weight_version"] = sample.weight_version
            choices.append(choice)
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or state.served_model_name,
            "choices": choices,
            "usage": _usage(len(prompt.token_ids), samples),
        }
        if token_ids:
            body["prompt_token_ids"] = prompt.token_ids
        return JSONResponse(body, headers=_with_weight_version(body, samples, headers))

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        req = await _parse(request, CompletionRequest, state)
        state.drift.count_request("completions")
        _check_common(req, state)
        if req.echo:
            raise ServingError("echo is not supported", param="echo")
        prompts = _completion_prompts(req, state)
        as_ids = bool(req.return_tokens_as_token_ids)
        choices: list[dict[str, Any]] = []
        all_samples: list[Sample] = []
        prompt_tokens = 0
        for prompt_ids in prompts:
            samples = await _generate(state, req, prompt_ids, req.max_tokens)
            prompt_tokens += len(prompt_ids)
            all_samples.extend(samples)
            for sample in samples:
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "text": _text(state, sample, req.stop_strings()),
                    "logprobs": _completion_logprobs(state, sample, as_ids) if req.logprobs is not None else None,
                    "finish_reason": sample.finish_reason,
                    "stop_reason": None,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = prompt_ids
                    choice["token_ids"] = sample.token_ids
                if sample.weight_version is not None:
                    choice["weight_version"] = sample.weight_version
                choices.append(choice)
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or state.served_model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, all_samples),
        }
        return JSONResponse(body, headers=_with_weight_version(body, all_samples, {}))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, TokenizeRequest, state)
        _check_model(req.model, state)
        if (req.prompt is None) == (req.messages is None):
            raise ServingError("send exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            if not req.messages:
                raise ServingError("messages must not be empty", param="messages")
            tokens = build_chat_prompt(
                state.tokenizer,
                req.messages,
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
                required_prefix_token_ids=req.required_prefix_token_ids,
                vocab_size=state.vocab_size,
                splice=state.token_id_correction,
            ).token_ids
        else:
            tokens = list(state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.profile.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest, state)
        _check_model(req.model, state)
        _check_vocab(req.tokens, state)
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return app


async def _parse[M: BaseModel](request: Request, model: type[M], state: ServingState) -> M:
    limit = state.limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServingError(f"request body exceeds {limit} bytes", 413)
    raw = bytearray()
    async for chunk in request.stream():
        raw.extend(chunk)
        if len(raw) > limit:
            raise ServingError(f"request body exceeds {limit} bytes", 413)
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ServingError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ServingError("the body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise ServingError(f"invalid request: {problems}") from exc


def _check_model(name: str | None, state: ServingState) -> None:
    if name is not None and name not in state.model_names:
        raise ServingError(f"The model `{name}` does not exist; this server serves {state.served_model_name!r}", 404)


def _check_common(req: SamplingFields, state: ServingState) -> None:
    _check_model(req.model, state)
    if req.stream:
        raise ServingError("stream=true is not supported by this server", param="stream")
    if req.n > state.limits.max_n:
        raise ServingError(f"n must be at most {state.limits.max_n}, got {req.n}", param="n")


def _check_vocab(ids: list[int], state: ServingState) -> None:
    if any(t < 0 or t >= state.vocab_size for t in ids):
        raise ServingError(f"token ids must lie in [0, {state.vocab_size})")


def _completion_prompts(req: CompletionRequest, state: ServingState) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
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


async def _generate(
    state: ServingState, req: SamplingFields, prompt_ids: list[int], requested: int | None, *, clamp: bool = False
) -> list[Sample]:
    greedy = resolve_greedy(req, state.profile)
    max_tokens = max_tokens_for(requested, len(prompt_ids), state.profile, clamp=clamp)
    sampling = (
        {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed}
        if state.profile.per_request_sampling
        else None
    )
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
        status = getattr(exc, "http_status", None) or 503
        state.drift.count_error(status)
        raise ServingError(f"upstream generation failed: {exc}", status) from exc
    except RolloutDataFailure as exc:
        status = getattr(exc, "http_status", None) or 500  # a malformed answer: not worth a client retry loop
        state.drift.count_error(status)
        raise ServingError(f"upstream generation failed: {exc}", status) from exc
    except RuntimeError as exc:
        if "shut down" in str(exc):
            raise ServingError(f"the generation engine is not available: {exc}", 503) from exc
        raise


def _text(state: ServingState, sample: Sample, stops: list[str]) -> str:
    """The visible text: special tokens skipped, cut before the first stop string (vLLM's default)."""
    text = state.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def _token_label(state: ServingState, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else state.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(state: ServingState, sample: Sample, as_ids: bool) -> dict[str, Any]:
    content = []
    for tok, lp in zip(sample.token_ids, sample.logprobs, strict=True):
        label = _token_label(state, tok, as_ids)
        content.append({"token": label, "logprob": lp, "bytes": list(label.encode()), "top_logprobs": []})
    return {"content": content}


def _completion_logprobs(state: ServingState, sample: Sample, as_ids: bool) -> dict[str, Any]:
    tokens = [_token_label(state, t, as_ids) for t in sample.token_ids]
    offsets, pos = [], 0
    for tok in sample.token_ids:
        offsets.append(pos)
        pos += len(state.tokenizer.decode([tok], skip_special_tokens=True))
    return {"tokens": tokens, "token_logprobs": sample.logprobs, "top_logprobs": None, "text_offset": offsets}


def _with_weight_version(body: dict[str, Any], samples: list[Sample], headers: dict[str, str]) -> dict[str, str]:
    """Top-level ``weight_version`` (the oldest among the choices; each choice has its own) and its header."""
    version = weight_version_of(samples)
    if version is None:
        return headers
    body["weight_version"] = version
    return {**headers, WEIGHT_VERSION_HEADER: str(version)}


def _usage(prompt_tokens: int, samples: list[Sample]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
