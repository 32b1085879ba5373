"""``report.html``: the trace viewer of a run folder, one self-contained file (inline CSS and JS, the run's data
embedded as JSON, nothing fetched), written beside ``report.md``.

The page lists every prompt group (agent, rewards, pass@1, termination, failure kind, drift) with filters and
sorting, and shows each completion's turns as the model saw them: the prompt tokens each model call added
(chat template, tool results), the generated tokens shaded by their sampling logprob, the tool calls and
results and final answer of Gym's response, the reward and the fields the grader compared. The table renders
only the rows in view and a completion only when opened, so a run of 10,000 completions opens in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

from gym_bridge.eval.store import FAILURES_FILE, RESULTS_FILE, RUN_FILE, read_jsonl
from gym_bridge.json_types import JsonObject

VIEWER_FILE = "report.html"
TEMPLATE = Path(__file__).with_name("viewer_template.html")
_DATA_MARK = "__GYM_BRIDGE_DATA__"
_HIDDEN_GYM_KEYS = {"responses_create_params", "response", "reward", "token_drift"}
"""Gym result keys shown elsewhere on the page; the rest is what the grader compared and returned."""


def _items(response: object) -> list[JsonObject]:
    """Gym's response output items, reduced to what a reader needs: messages, tool calls, tool results."""
    if not isinstance(response, dict):
        return []
    items: list[JsonObject] = []
    for item in response.get("output") or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            text = "".join(part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict))
            items.append({"type": "message", "text": text})
        elif kind == "function_call":
            items.append({"type": "call", "name": item.get("name"), "arguments": item.get("arguments")})
        elif kind == "function_call_output":
            items.append({"type": "result", "output": item.get("output")})
        elif kind == "reasoning":
            summary = item.get("summary") or item.get("content") or []
            text = "".join(part.get("text", "") for part in summary if isinstance(part, dict))
            items.append({"type": "reasoning", "text": text})
    return items


def _completion(c: JsonObject) -> JsonObject:
    gym = c.get("gym_result") if isinstance(c.get("gym_result"), dict) else {}
    assert isinstance(gym, dict)
    return {
        "reward": c.get("reward"),
        "termination": c.get("termination"),
        "truncated": bool(c.get("truncated")),
        "masked": bool(c.get("masked")),
        "failure_kind": c.get("failure_kind"),
        "drift": gym.get("token_drift") if c.get("token_drift") or gym.get("token_drift") else None,
        "generated_tokens": c.get("generated_tokens"),
        "turns": c.get("turns"),
        "trace": c.get("trace"),
        "text": c.get("text", ""),
        "items": _items(gym.get("response")),
        "grader": {k: v for k, v in gym.items() if k not in _HIDDEN_GYM_KEYS},
    }


def _prompt_text(record: JsonObject) -> str:
    try:
        items = record["completions"][0]["gym_result"]["responses_create_params"]["input"]
    except (KeyError, IndexError, TypeError):
        return ""
    if isinstance(items, str):
        return items
    users = [i.get("content") for i in items if isinstance(i, dict) and i.get("role") == "user"]
    last = users[-1] if users else ""
    return last if isinstance(last, str) else json.dumps(last)


def viewer_data(run_dir: str | Path) -> JsonObject:
    """What the page shows, from the run folder's files alone."""
    run_dir = Path(run_dir)
    run = json.loads((run_dir / RUN_FILE).read_text())
    threshold = float(run.get("config", {}).get("pass_threshold", 1.0))
    groups = []
    for record in read_jsonl(run_dir / RESULTS_FILE):
        completions = [_completion(c) for c in record.get("completions", [])]
        groups.append(
            {
                "idx": record.get("prompt_idx"),
                "line": record.get("line"),
                "row_id": record.get("row_id"),
                "agent": record.get("agent"),
                "prompt": _prompt_text(record),
                "completions": completions,
            }
        )
    done = {g["idx"] for g in groups}
    failures = [
        {k: f.get(k) for k in ("prompt_idx", "line", "agent", "error", "class", "message")}
        for f in read_jsonl(run_dir / FAILURES_FILE)
        if f.get("prompt_idx") not in done
    ]
    return {
        "run": {
            "dir": str(run_dir),
            "model": run.get("model"),
            "pass_threshold": threshold,
            "prompts_total": run.get("prompts_total"),
            "rescored_from": (run.get("rescore") or {}).get("source"),
        },
        "groups": groups,
        "failures": failures,
    }


def render_viewer(data: JsonObject) -> str:
    """The page: the template with ``data`` embedded as JSON; every ``<`` is escaped (``\\u003c``, inside JSON
    strings only), so no string can end the script element."""
    payload = json.dumps(data, separators=(",", ":"), default=str).replace("<", "\\u003c")
    return TEMPLATE.read_text().replace(_DATA_MARK, payload, 1)


def build_viewer(run_dir: str | Path) -> Path:
    """Write ``report.html`` into ``run_dir``; return its path."""
    path = Path(run_dir) / VIEWER_FILE
    path.write_text(render_viewer(viewer_data(run_dir)))
    return path
