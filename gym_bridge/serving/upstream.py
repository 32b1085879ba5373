"""A token-faithful proxy in front of stock OpenAI-compatible engines (vLLM, SGLang, ours).

:func:`build_proxy` composes what already exists: :class:`OpenAIServer` (chat
template rendered locally, carried token ids spliced in, tool-call and reasoning
parsing, drift accounting) over :class:`OpenAIHTTPGeneration` (token-id prompts to
each upstream's ``/v1/completions``, logprobs, routing across upstreams, typed
errors). The upstream never sees a chat, so it never re-tokenises history.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import cast

import httpx
from pydantic import SecretStr

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymBridgeError
from gym_bridge.generation.openai_http import OpenAIHTTPGeneration
from gym_bridge.generation.openai_http_config import OpenAIHTTPGenerationConfig
from gym_bridge.generation.upstream_answer import check_max_model_len, decode_answer, read_response
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.models.vocab import vocab_size_of
from gym_bridge.serving.server import OpenAIServer
from gym_bridge.serving.state import ServerLimits
from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)


class UpstreamError(GymBridgeError, ValueError):
    """The proxy cannot be built: no upstream given, or the first one's ``/v1/models`` cannot say what it serves."""


@dataclass(frozen=True)
class UpstreamModel:
    """What an upstream's ``GET /v1/models`` says about its first model."""

    name: str
    root: str | None
    max_model_len: int | None


def normalize_upstream(url: str) -> str:
    """``http://host:8000`` and ``http://host:8000/v1/`` both become ``http://host:8000/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def discover_upstream(
    base_url: str, *, timeout_s: float = 10.0, api_key: SecretStr | str | None = None
) -> UpstreamModel:
    """Ask ``{base_url}/models`` for the served name, model path and context length (vLLM reports all three).

    Raises :class:`UpstreamError` when nothing answers, the key is refused, no model is listed, or the answer is
    too large or holds a field that is wrong (a ``max_model_len`` that is no positive int).
    """
    key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    where = f"upstream {shown(base_url)}: GET /models"
    try:
        with httpx.stream("GET", f"{base_url}/models", timeout=timeout_s, headers=headers) as response:
            status = response.status_code
            body = read_response(response, where)
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{where} failed ({type(exc).__name__}: {shown(exc)})") from None
    except UntrustedInputError as exc:
        raise UpstreamError(str(exc)) from None
    if status in (401, 403):
        raise UpstreamError(f"upstream {shown(base_url)} refused the API key ({status})")
    if status != 200:
        raise UpstreamError(f"{where} answered HTTP {status}")
    try:
        return _model_card(decode_answer(body, where), where)
    except UntrustedInputError as exc:
        raise UpstreamError(str(exc)) from None


def _model_card(answer: object, where: str) -> UpstreamModel:
    """The first model card of a ``/models`` answer, each field checked."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    card = cards[0] if isinstance(cards, list) and cards else None
    if not isinstance(card, dict) or not isinstance(card.get("id"), str) or not card["id"]:
        raise UntrustedInputError(f"{where} lists no model")
    root = card.get("root")
    if root is not None and not isinstance(root, str):
        raise UntrustedInputError(f"{where}: data[0].root is not a model path (a string)")
    length = check_max_model_len(card.get("max_model_len"), where)
    return UpstreamModel(name=card["id"], root=root, max_model_len=length)


def build_proxy(
    upstreams: list[str],
    tokenizer: str | Tokenizer | None = None,
    served_model_name: str | None = None,
    *,
    upstream_model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    reasoning_parser: bool = False,
    max_model_len: int | None = None,
    api_key: SecretStr | str | None = None,
    inbound_api_key: SecretStr | str | None = None,
    limits: ServerLimits | None = None,
    http_options: JsonMapping | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    sock: socket.socket | None = None,
) -> OpenAIServer:
    """An :class:`OpenAIServer` that generates through ``upstreams`` (base URLs; ``/v1`` is added if missing).

    ``tokenizer`` is a loaded tokenizer or a path / hub id; None loads the model path
    the first upstream reports. ``upstream_model`` (the name sent upstream),
    ``served_model_name`` (the name clients use; default the upstream's) and
    ``max_model_len`` are asked of the first upstream's ``/v1/models`` when not given.
    ``api_key`` is sent to the upstreams (``Authorization: Bearer``); ``inbound_api_key`` is what the proxy
    itself requires of its clients on ``/v1/*``, as ``vllm serve --api-key`` does.
    ``http_options`` override :class:`OpenAIHTTPGenerationConfig` fields (retries,
    timeouts, connections); ``transport`` replaces the generation requests' network
    (tests; discovery still asks the real upstream). ``sock``: a socket already listening on ``host``
    (:func:`~gym_bridge.serving.listen.listening_socket`).
    The server is returned unstarted: ``start()`` / ``start_in_thread()``.
    """
    if not upstreams:
        raise UpstreamError("build_proxy needs at least one upstream URL")
    base_urls = [normalize_upstream(u) for u in upstreams]
    needs_discovery = upstream_model is None or max_model_len is None or tokenizer is None
    found = discover_upstream(base_urls[0], api_key=api_key) if needs_discovery else None
    model_name = upstream_model or (found.name if found is not None else None)
    if not model_name:
        raise UpstreamError("upstream_model must be a model name, not empty")
    length = max_model_len or (found.max_model_len if found else None)
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = _load_tokenizer(tokenizer or (found.root if found else None) or model_name)
    if length is None:
        model_max = getattr(tokenizer, "model_max_length", None)
        length = model_max if isinstance(model_max, int) and 0 < model_max < 2**31 else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    options: JsonObject = {
        "base_urls": base_urls,
        "model": model_name,
        "max_new_tokens": length or 2**31 - 1,  # only a default: every request sends its own budget
        "pad_token_id": pad,
        "max_retries": 2,  # connection failures move to another upstream; clients retry the rest
        "backoff_base_s": 0.1,
        "max_backoff_s": 1.0,
        "api_key": SecretStr(api_key) if isinstance(api_key, str) else api_key,
    }
    options.update(http_options or {})
    generation = OpenAIHTTPGeneration(
        OpenAIHTTPGenerationConfig.model_validate(options), transport=transport, vocab_size=vocab_size_of(tokenizer)
    )
    logger.info("token-faithful proxy for %r over %s", model_name, ", ".join(base_urls))
    return OpenAIServer(
        generation,
        tokenizer,
        served_model_name=served_model_name or model_name,
        host=host,
        port=port,
        reasoning_parser=reasoning_parser,
        model_path=getattr(tokenizer, "name_or_path", None) or model_name,
        max_model_len=length,
        limits=limits,
        api_key=inbound_api_key,
        sock=sock,
    )


def _load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path`` (a folder or a hub id), or :class:`UpstreamError` naming it."""
    from gym_bridge.models.folder_check import load_tokenizer

    try:
        loaded = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UpstreamError(f"cannot load the tokenizer {path!r} (pass --tokenizer a local folder): {first}") from None
    # transformers 5 types ``decode`` as returning ``str | list[str]``; for a list of ids it is a str.
    return cast(Tokenizer, loaded)
