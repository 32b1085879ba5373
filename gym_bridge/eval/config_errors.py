"""The eval config's validation errors as one line naming each key: ``policies`` entries by their name, an API key
or a flat retry setting answered with where it belongs, an unknown key with the keys there are."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from pydantic import ValidationError

from gym_bridge.eval.policy_entry import PolicyEntry
from gym_bridge.failures import RolloutRetryPolicy
from gym_bridge.json_types import JsonMapping

_FLAT_RETRY_KEYS = {
    "max_row_attempts": "max_gym_row_attempts",
    "max_infra_attempts": "max_infra_attempts",
    "max_data_attempts": "max_data_attempts",
    "max_consecutive_dropped_prompts": "max_consecutive_dropped_prompts",
    "retry_backoff_s": "backoff_base_s",
}
"""Top-level keys that name a retry setting, and the ``retry:`` key that holds it."""


def format_errors(
    exc: ValidationError,
    known: Iterable[str],
    *,
    prefix: str = "invalid eval config: ",
    data: JsonMapping | None = None,
) -> str:
    """One line: every error with its key (``policies`` entries named by their ``name`` where ``data`` has it);
    an unknown key is answered with the ``known`` keys of the config."""
    entries = (data or {}).get("policies")
    lines = []
    for err in exc.errors():
        loc = list(err["loc"])
        key = ".".join(str(p) for p in loc)
        message = err["msg"].removeprefix("Value error, ")
        if len(loc) >= 3 and loc[0] == "policies" and isinstance(loc[1], int):
            if err["type"] == "extra_forbidden":
                message = f"unknown key; known keys: {', '.join(PolicyEntry.model_fields)}"
            name = (
                entries[loc[1]].get("name") if isinstance(entries, list) and isinstance(entries[loc[1]], dict) else None
            )
            where = f"policy {name!r} (policies.{loc[1]})" if name is not None else f"policies.{loc[1]}"
            lines.append(f"{where}: {'.'.join(str(p) for p in loc[2:])}: {message}")
            continue
        if err["type"] == "extra_forbidden" and key == "api_key":
            message = (
                "an API key is never written in the config (it is copied into run.json); put it in "
                "$OPENAI_API_KEY or in the environment variable api_key_env_var names"
            )
        elif err["type"] == "extra_forbidden" and key in _FLAT_RETRY_KEYS:
            message = f"a retry setting: give it as retry.{_FLAT_RETRY_KEYS[key]}"
        elif err["type"] == "extra_forbidden":
            message = f"unknown key; known keys: {', '.join(known)}"
        elif err["type"] == "unexpected_keyword_argument" and loc[:1] == ["retry"]:
            message = f"unknown key; known keys: {', '.join(f.name for f in fields(RolloutRetryPolicy))}"
        lines.append(f"{key}: {message}" if key else message)  # a check of several keys names them itself
    return prefix + "; ".join(lines)
