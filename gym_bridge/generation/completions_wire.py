"""The ``/v1/completions`` wire format in vLLM's dialect: one row's request body, and its response parsed.

Token in, token out: the request's ``prompt`` is the row's token ids, with
``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs`` and the row's
``seed`` if it has one; the response gives the generated token ids
(``choices[0].token_ids``, else ``logprobs.tokens`` as ``"token_id:<int>"`` strings),
their logprobs and the finish reason. A malformed
response is a :class:`~gym_bridge.failures.RolloutDataFailure` naming the field
(:mod:`~gym_bridge.generation.upstream_answer` checks it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.boundary import UntrustedInputError
from gym_bridge.failures import RolloutDataFailure
from gym_bridge.failures.errors import SettingError
from gym_bridge.generation.batch import check_input
from gym_bridge.generation.openai_http_config import OpenAIHTTPGenerationConfig
from gym_bridge.generation.upstream_answer import completion_choice
from gym_bridge.json_types import JsonObject
from gym_bridge.types import GenerationDatumSpec

#: Per-row columns of a generation batch that override the config's sampling (None = the config's value;
#: for ``seed``: none sent, so the endpoint samples unseeded).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")


def row_value[T](column: Sequence[T] | None, i: int) -> T | None:
    """Row ``i`` of an optional per-row column."""
    return None if column is None else column[i]


def completion_request(
    cfg: OpenAIHTTPGenerationConfig,
    prompt: list[int],
    data: BatchedDataDict[GenerationDatumSpec] | None,
    i: int,
    greedy: bool,
) -> JsonObject:
    """The ``/completions`` body for row ``i`` of ``data`` (its per-row sampling and stop strings over ``cfg``)."""
    columns: BatchedDataDict[GenerationDatumSpec] = data if data is not None else BatchedDataDict()
    row = {k: v for k in SAMPLING_KEYS if (v := row_value(columns.get(k), i)) is not None}
    row_stops = row_value(columns.get("stop_strings"), i)
    temperature = float(row.get("temperature", cfg.temperature))
    top_k = row.get("top_k", cfg.top_k)
    stops = list(cfg.stop_strings or [])
    if isinstance(row_stops, str):
        row_stops = [row_stops]
    for s in row_stops or []:
        if s and s not in stops:
            stops.append(s)
    body: JsonObject = {
        "model": cfg.model,
        "prompt": prompt,
        "max_tokens": int(row.get("max_new_tokens", cfg.max_new_tokens)),
        "temperature": 0.0 if greedy else temperature,
        "top_p": float(row.get("top_p", cfg.top_p)),
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if top_k is not None:
        body["top_k"] = int(top_k)
    if row.get("seed") is not None:
        body["seed"] = int(row["seed"])
    if stops:
        body["stop"] = stops
    if cfg.stop_token_ids is not None:
        body["stop_token_ids"] = list(cfg.stop_token_ids)
    return body


def check_batch(data: BatchedDataDict[GenerationDatumSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, input_lengths)`` of a generation batch, its per-row columns checked."""
    input_ids, lengths = check_input(data)
    batch = input_ids.shape[0]
    for key in ("stop_strings", "session_ids"):
        column = data.get(key)
        if column is not None and len(column) != batch:
            raise SettingError(f"{key} has {len(column)} rows, input_ids {batch}")
    sessions = data.get("session_ids")
    if sessions is not None and not all(s is None or isinstance(s, Hashable) for s in sessions):
        raise TypeError("session_ids must hold hashable keys or None")
    return input_ids, lengths


def parse_completion(payload: object, url: str, vocab_size: int | None = None) -> tuple[list[int], list[float], bool]:
    """(generated ids, their logprobs, truncated) from a completions response (parsed JSON), every field checked
    (:func:`~gym_bridge.generation.upstream_answer.completion_choice`): a malformed answer is one
    :class:`~gym_bridge.failures.RolloutDataFailure` naming the field, with ``http_status`` 502 (a bad gateway)."""
    try:
        ids, logprobs, finish = completion_choice(payload, f"{url}/completions response", vocab_size)
    except UntrustedInputError as exc:
        raise bad_answer(str(exc)) from None
    return ids, logprobs, finish == "length"


def bad_answer(message: str) -> RolloutDataFailure:
    """The failure of an upstream answer that cannot be used: a 502 when a proxy hands it on."""
    failure = RolloutDataFailure(message)
    failure.http_status = 502
    return failure
