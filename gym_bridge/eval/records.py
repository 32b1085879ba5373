"""What one finished prompt group or one failure looks like on disk (a JSON line each)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

from gym_bridge.failures import classify_rollout_failure

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


ROW_ID_KEY = "row_id"
"""The result line's key for :func:`row_id`: what ``gym-bridge compare`` matches runs by."""
_LOGPROB_DIGITS = 3


def row_id(row: Any) -> str:
    """A dataset row's identity: sha256 of its canonical JSON (sorted keys, no spaces), 16 hex digits.

    The same row has the same id in any file, at any position, so runs of one dataset are matched
    prompt by prompt even when the files order or subset the rows differently.
    """
    canonical = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def trace_record(completion: Completion, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The completion's message log as the model saw it, one entry per message: the prompt tokens each model
    call added (``role`` user: chat template, tool results) as text, and each model call's generated tokens
    one by one with their sampling logprobs (what the trace viewer shades)."""
    steps: list[dict[str, Any]] = []
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


def completion_record(completion: Completion, tokenizer: Tokenizer) -> dict[str, Any]:
    log = completion.message_log
    assistant = [m for m in log if m["role"] == "assistant"]
    texts = [tokenizer.decode(m["token_ids"].tolist(), skip_special_tokens=True) for m in assistant]
    return {
        "reward": completion.reward,
        "truncated": completion.truncated,
        "termination": termination_reason(completion),
        "text": texts[-1] if texts else "",
        "turn_texts": texts,
        "turns": len(assistant),
        "prompt_tokens": sum(int(m["token_ids"].numel()) for m in log if m["role"] != "assistant"),
        "generated_tokens": sum(int(m["token_ids"].numel()) for m in assistant),
        "total_tokens": sum(int(m["token_ids"].numel()) for m in log),
        "masked": completion.masked,
        "failure_kind": completion.failure_kind,
        "token_drift": completion.token_drift,
        "seed": completion.seed,
        "trace": trace_record(completion, tokenizer),
        "gym_result": completion.env_extras,
    }


def group_record(
    record: PromptGroupRecord, *, agent: str, line: int, tokenizer: Tokenizer, elapsed_s: float
) -> dict[str, Any]:
    return {
        "prompt_idx": record.prompt_idx,
        ROW_ID_KEY: row_id(record.extra_env_info),
        "line": line,
        "agent": agent,
        "completions": [completion_record(c, tokenizer) for c in record.completions],
        "elapsed_s": elapsed_s,
        "finished_at": time.time(),
    }


def failure_record(exc: BaseException, *, prompt_idx: int, agent: str, line: int, elapsed_s: float) -> dict[str, Any]:
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
