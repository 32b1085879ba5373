"""What a run folder's files hold: one finished prompt group or one failure per JSON line, and ``run.json``.

The writers build plain dicts (:func:`group_record`, :func:`failure_record`); the readers check what they use
against the pydantic models below (:class:`ResultLine`, :class:`FailureLine`, :class:`RunFile`), strictly (no
string read as a number, no NaN), so a hand-edited or hostile file is refused by field, never half-used.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    InstanceOf,
    NonNegativeInt,
    PositiveInt,
    field_validator,
)

from gym_bridge.failures import classify_rollout_failure
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.metrics import token_counts

if TYPE_CHECKING:  # torch stays out of the readers' imports (compare, the viewer)
    from gym_bridge.types import Completion, PromptGroupRecord, Tokenizer


def termination_reason(completion: Completion) -> str:
    """Why a completion ended: Gym's ``incomplete_details.reason`` (e.g. ``max_output_tokens``),
    ``token_drift``, ``max_seq_len``, or ``stop`` (the model finished)."""
    if completion.incomplete_reason:
        return completion.incomplete_reason
    if completion.token_drift:
        return "token_drift"
    if completion.truncated:
        return "max_seq_len"
    return "stop"


STAMP_PREFIXES: Final = ("_ng_", "_rowidx")
"""Keys a row gains where it enters (its Gym task and rollout numbering, its index), not from its dataset line."""
ROW_ID_KEY: Final = "row_id"
"""The result line's key for :func:`row_id`: what ``gym-bridge compare`` matches runs by."""
_LOGPROB_DIGITS = 3


def row_id(row: object) -> str:
    """A dataset row's identity: sha256 of its canonical JSON (sorted keys, no spaces), 16 hex digits.

    The same row has the same id in any file, at any position, so runs of one dataset are matched
    prompt by prompt even when the files order or subset the rows differently: the keys the bridge stamps as a row
    enters (Gym's ``_ng_*`` rollout identity, ``_rowidx``) are left out.
    """
    if isinstance(row, dict):  # the bridge's stamps (Gym's rollout numbering, ...) are no part of what the row asks
        row = {key: value for key, value in row.items() if not key.startswith(STAMP_PREFIXES)}
    canonical = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def trace_record(completion: Completion, tokenizer: Tokenizer) -> list[JsonObject]:
    """The completion's message log as the model saw it, one entry per message: the prompt tokens each model
    call added (``role`` user: chat template, tool results) as text, and each model call's generated tokens
    one by one with their sampling logprobs (what the trace viewer shades)."""
    steps: list[JsonObject] = []
    for message in completion.message_log:
        ids = message["token_ids"].tolist()
        if message["role"] != "assistant":
            steps.append({"role": message["role"], "text": tokenizer.decode(ids)})
            continue
        logprobs = message.get("generation_logprobs")
        values = logprobs.tolist() if logprobs is not None else []
        steps.append(
            {
                "role": "assistant",
                "tokens": tokenizer.batch_decode([[t] for t in ids]) if ids else [],
                "logprobs": [round(float(v), _LOGPROB_DIGITS) for v in values] if len(values) == len(ids) else None,
            }
        )
    return steps


def generated_texts(completion: Completion, tokenizer: Tokenizer) -> list[str]:
    """Each model call's generated text without special tokens (``tokenizer.decode(ids, skip_special_tokens=True)``).

    The NemoGym actor already decoded every call (``generation_str`` on Gym's output item, special tokens
    kept); that text is used, its trailing special tokens cut, wherever it is exactly the decode
    (:func:`_special_ids`). Otherwise, and for a completion without it, the tokens are decoded here.
    """
    assistant = [m["token_ids"].tolist() for m in completion.message_log if m["role"] == "assistant"]
    gym_texts: list[str | None] = list(_gym_generation_strs(completion.env_extras))
    special = _special_ids(tokenizer) if gym_texts else None
    if special is None or len(gym_texts) != len(assistant):
        gym_texts = [None] * len(assistant)
    return [_generated_text(ids, text, tokenizer, special) for ids, text in zip(assistant, gym_texts, strict=True)]


def _gym_generation_strs(env_extras: JsonMapping | None) -> list[str]:
    """The ``generation_str`` of each converted output item of a Gym result, in model-call order."""
    response = (env_extras or {}).get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return []
    return [
        item["generation_str"]
        for item in output
        if isinstance(item, Mapping) and isinstance(item.get("generation_str"), str)
    ]


def _special_ids(tokenizer: Tokenizer) -> frozenset[int] | None:
    """The ids ``skip_special_tokens`` leaves out, for a tokenizer whose decode is a join of its tokens' bytes
    (:func:`gym_bridge.gym.protocol.decode.token_bytes_table`), so cutting special tokens off the text equals leaving
    them out of the decode; None for any other tokenizer."""
    from gym_bridge.gym.protocol.decode import token_bytes_table

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or token_bytes_table(tokenizer) is None:
        return None
    added = backend.get_added_tokens_decoder()
    return frozenset(int(token_id) for token_id, token in added.items() if token.special)


def _generated_text(ids: list[int], gym_text: str | None, tokenizer: Tokenizer, special: frozenset[int] | None) -> str:
    """``ids`` decoded without special tokens: ``gym_text`` (all of ``ids`` decoded) with the text of its trailing
    special tokens cut, when no other token is special; else ``ids`` decoded here."""
    if gym_text is not None and special is not None:
        body = len(ids)
        while body and ids[body - 1] in special:
            body -= 1
        tail = tokenizer.decode(ids[body:]) if body < len(ids) else ""
        if not special.intersection(ids[:body]) and gym_text.endswith(tail):
            return gym_text[: len(gym_text) - len(tail)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def completion_record(completion: Completion, tokenizer: Tokenizer) -> JsonObject:
    texts = generated_texts(completion, tokenizer)
    counts = token_counts(completion.message_log)
    return {
        "reward": completion.reward,
        "truncated": completion.truncated,
        "termination": termination_reason(completion),
        "text": texts[-1] if texts else "",
        "turn_texts": texts,
        "turns": len(texts),
        "prompt_tokens": counts.prompt,
        "generated_tokens": counts.generated,
        "total_tokens": counts.total,
        "masked": completion.masked,
        "failure_kind": completion.failure_kind,
        "token_drift": completion.token_drift,
        "seed": completion.seed,
        "trace": trace_record(completion, tokenizer),
        "gym_result": completion.env_extras,
    }


def group_record(
    record: PromptGroupRecord, *, agent: str, line: int, tokenizer: Tokenizer, elapsed_s: float
) -> JsonObject:
    return {
        "prompt_idx": record.prompt_idx,
        ROW_ID_KEY: row_id(record.extra_env_info),
        "line": line,
        "agent": agent,
        "completions": [completion_record(c, tokenizer) for c in record.completions],
        "elapsed_s": elapsed_s,
        "finished_at": time.time(),
    }


def failure_record(exc: BaseException, *, prompt_idx: int, agent: str, line: int, elapsed_s: float) -> JsonObject:
    return {
        "prompt_idx": prompt_idx,
        "line": line,
        "agent": agent,
        "error": type(exc).__name__,
        "message": str(exc)[:2000],
        "class": classify_rollout_failure(exc).value,
        "elapsed_s": elapsed_s,
        "finished_at": time.time(),
    }


# ---- what the readers check ------------------------------------------------------------------


def _no_nul(text: str) -> str:
    """Refuse a NUL character, which no path may hold (``Path.resolve`` would raise on it)."""
    if "\x00" in text:
        raise ValueError("holds a NUL character")
    return text


REPEAT_MARK: Final = "#"
"""What a reader's key for the k-th repeat of an identical row appends to its ``row_id`` (``x#1``)."""
NO_ROW_ID: Final = "idx:"
"""What a reader's key for a line without a ``row_id`` is (``idx:<prompt_idx>``)."""


def _not_a_reader_key(text: str) -> str:
    """Refuse a ``row_id`` that could equal a key the readers make (a repeat's ``x#1``, an ``idx:3``): two rows
    would then be counted, and compared, as one."""
    if REPEAT_MARK in text or text.startswith(NO_ROW_ID):
        raise ValueError(
            f"holds {REPEAT_MARK!r} or starts with {NO_ROW_ID!r}, which the readers' keys for repeated rows use"
        )
    return text


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A finite number (an integer is read as one); never a string, a bool, NaN or infinity."""
PathText = Annotated[str, AfterValidator(_no_nul)]
"""A path as text, without a NUL character."""
RowIdText = Annotated[str, AfterValidator(_not_a_reader_key)]
"""A ``row_id`` as written (:func:`row_id`: hex digits); never one that could collide with a reader's key."""


class _OnDisk(BaseModel):
    """Strict: a string is not a number, a number is not a bool; keys a reader does not use are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class CompletionLine(_OnDisk):
    """One completion of a result line, the fields the readers use (``report``, ``compare``, ``rescore``)."""

    reward: FiniteFloat
    truncated: bool = False
    termination: str | None = None
    turns: NonNegativeInt | None = None
    generated_tokens: NonNegativeInt | None = None
    total_tokens: NonNegativeInt | None = None
    gym_result: InstanceOf[dict] | None = None  # type: ignore[type-arg]
    """Gym's result as stored; checked to be an object, not copied."""

    @field_validator("gym_result")
    @classmethod
    def _prompt_is_text_or_items(cls, gym_result: JsonObject | None) -> JsonObject | None:
        """The prompt the readers preview (``responses_create_params.input``) is Gym's: a string or a list."""
        params = (gym_result or {}).get("responses_create_params")
        if params is not None and not isinstance(params, dict):
            raise ValueError("responses_create_params is not an object")
        prompt = (params or {}).get("input")
        if prompt is not None and not isinstance(prompt, str | list):
            raise ValueError(f"responses_create_params.input is neither a string nor a list ({type(prompt).__name__})")
        return gym_result


class PromptLine(_OnDisk):
    """A ``results.jsonl`` line's prompt: what every reader of the file checks (one line per prompt)."""

    prompt_idx: NonNegativeInt
    row_id: RowIdText | None = None


class _Reward(_OnDisk):
    reward: FiniteFloat


class ResumeLine(PromptLine):
    """What ``eval --resume`` reads of a ``results.jsonl`` line: the prompt it finished and its rewards (the
    progress bar's running mean)."""

    completions: list[_Reward] = Field(default_factory=list)


class ResultLine(PromptLine):
    """One line of ``results.jsonl``: a finished prompt group."""

    agent: str
    line: NonNegativeInt | None = None
    """The row's line in the dataset."""
    completions: list[CompletionLine] = Field(min_length=1)
    elapsed_s: FiniteFloat | None = None
    finished_at: FiniteFloat | None = None


class FailureLine(_OnDisk):
    """One line of ``failures.jsonl``: a prompt group that failed (a later resume may have finished it)."""

    prompt_idx: NonNegativeInt
    line: NonNegativeInt | None = None
    """The row's line in the dataset."""
    agent: str | None = None
    error: str
    message: str = ""
    failure_class: str = Field("", alias="class")


class RunSession(_OnDisk):
    """One start of ``gym-bridge eval`` (or a rescore) recorded in ``run.json``."""

    started: FiniteFloat
    ended: FiniteFloat
    rollouts_started: FiniteFloat | None = None
    outcome: str | None = None


class RunConfigFields(_OnDisk):
    """The eval config stored in ``run.json`` (``config``), the keys the readers use."""

    pass_threshold: FiniteFloat = 1.0
    config_paths: list[PathText] = Field(default_factory=list)
    gym_overrides: dict[str, Any] = Field(default_factory=dict)
    dataset: PathText | None = None
    model_name: str | None = None
    base_urls: list[str] | None = None
    embedded_policy: str | None = None
    tokenizer: str | None = None


class RunFingerprint(_OnDisk):
    """The settings a resumed run must share (``run.json``'s ``fingerprint``), the keys the readers use."""

    dataset_sha256: str | None = None
    num_generations_per_prompt: PositiveInt | None = None
    config_paths: list[PathText] | None = None
    gym_overrides: dict[str, Any] | None = None


class RescoreNote(_OnDisk):
    """``run.json``'s ``rescore``: the run folder a rescore was made from."""

    source: PathText | None = None


class RunFile(_OnDisk):
    """``run.json``: the fingerprint, the config, the model in words, the dataset size and the sessions."""

    fingerprint: RunFingerprint = Field(default_factory=RunFingerprint)
    config: RunConfigFields = Field(default_factory=RunConfigFields)
    model: str | None = None
    prompts_total: NonNegativeInt | None = None
    sessions: list[RunSession] = Field(default_factory=list)
    rescore: RescoreNote | None = None
