"""What one finished prompt group or one failure looks like on disk (a JSON line each)."""

from __future__ import annotations

import time
from typing import Any

from gym_bridge.failures import classify_rollout_failure
from gym_bridge.types import Completion, PromptGroupRecord


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


def completion_record(completion: Completion, tokenizer: Any) -> dict[str, Any]:
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
        "gym_result": completion.env_extras,
    }


def group_record(
    record: PromptGroupRecord, *, agent: str, line: int, tokenizer: Any, elapsed_s: float
) -> dict[str, Any]:
    return {
        "prompt_idx": record.prompt_idx,
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
