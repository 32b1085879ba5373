"""``report.html``: the trace viewer of a run folder, one self-contained file (inline CSS and JS, the run's data
embedded as JSON, nothing fetched), written beside ``report.md``.

The page lists every prompt group (agent, rewards, pass@1, termination, failure kind, drift) with filters and
sorting, and shows each completion's turns as the model saw them: the prompt tokens each model call added
(chat template, tool results), the generated tokens shaded by their sampling logprob, the tool calls and
results and final answer of Gym's response, the reward and the fields the grader compared. The table renders
only the rows in view and a completion only when opened, so a run of 10,000 completions opens in seconds.

A run folder is untrusted (model output is attacker-controlled, and folders travel between people): every value
is reduced here to text or a checked number (:func:`text`, :func:`number`; a non-finite number travels as the
string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` and is shown as such), whatever type the file gave it; the
page escapes all of it, and its Content-Security-Policy runs only its own script, named by hash.

The page is bounded, whatever the run's size: the results are streamed line by line through the run-folder
reader (:func:`~gym_bridge.eval.runs.iter_objects`), and each group is reduced to its page form and serialised
as it passes (:class:`ViewerPage`), so only the page's bytes are kept. Groups are embedded whole (every trace,
tool call and grader field) until :data:`MAX_DETAIL_BYTES` of data; after that each group keeps what the table
shows (rewards, termination, flags, token counts) and each completion says where its trace is
(``results.jsonl`` line), until :data:`MAX_PAGE_BYTES`; later groups are left out, and ``report.md`` says how
many of each (:attr:`ViewerPage.summary`). The page is written through
:func:`~gym_bridge.boundary.files.write_atomic` (a link planted at ``report.html`` is replaced, not followed).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import read_text
from gym_bridge.boundary.json_io import dumps, loads, loads_object
from gym_bridge.eval.output_files import write_files
from gym_bridge.eval.runs import (
    FAILURES_FILE,
    MAX_RUN_JSON_DEPTH,
    RESULTS_FILE,
    RUN_FILE,
    ReadLimits,
    iter_objects,
    read_file,
)
from gym_bridge.json_types import JsonObject

VIEWER_FILE = "report.html"
TEMPLATE = Path(__file__).with_name("viewer_template.html")
_TEMPLATE_MAX_BYTES = 1 << 20
"""The page template's size cap (it ships with the package: tens of kilobytes)."""
_DATA_MARK = "__GYM_BRIDGE_DATA__"
_HASH_MARK = "__GYM_BRIDGE_SCRIPT_HASH__"
_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)
_TEXT_LIMIT = 1 << 20
"""Characters of one value the page shows (a longer one is cut, saying so)."""
_HIDDEN_GYM_KEYS = {"responses_create_params", "response", "reward", "token_drift"}
"""Gym result keys shown elsewhere on the page; the rest is what the grader compared and returned."""
MAX_DETAIL_BYTES = 48 << 20
"""Bytes of page data of groups embedded whole (traces, tool calls, grader fields): ~40,000 completions of an
eval of short answers. A browser opens a page of this size in a few seconds."""
MAX_PAGE_BYTES = 64 << 20
"""Bytes of page data in all: past :data:`MAX_DETAIL_BYTES` groups keep only what the table shows."""


def text(value: object, limit: int = _TEXT_LIMIT) -> str:
    """``value`` as text: a string as is, None as nothing, anything else as JSON (numbers, objects), cut to
    ``limit`` characters."""
    if value is None:
        return ""
    if not isinstance(value, str):
        value = json.dumps(value, default=str, allow_nan=True, ensure_ascii=False)
    return value if len(value) <= limit else value[:limit] + f"... [cut: {len(value)} characters]"


def optional_text(value: object) -> str | None:
    """None as None, anything else as :func:`text`."""
    return None if value is None else text(value)


def number(value: object) -> float | int | str | None:
    """A checked number: a finite int or float as is, a non-finite float as ``"NaN"`` / ``"Infinity"`` /
    ``"-Infinity"``; anything else (a string, a bool, an object) is not a number: None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _mapping(value: object) -> JsonObject:
    return value if isinstance(value, dict) else {}


def _sequence(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _items(response: object) -> list[JsonObject]:
    """Gym's response output items, reduced to what a reader needs: messages, tool calls, tool results."""
    items: list[JsonObject] = []
    for item in _sequence(_mapping(response).get("output")):
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            items.append({"type": "message", "text": _parts_text(item.get("content"))})
        elif kind == "function_call":
            items.append({"type": "call", "name": text(item.get("name")), "arguments": text(item.get("arguments"))})
        elif kind == "function_call_output":
            items.append({"type": "result", "output": text(item.get("output"))})
        elif kind == "reasoning":
            items.append({"type": "reasoning", "text": _parts_text(item.get("summary") or item.get("content"))})
    return items


def _parts_text(parts: object) -> str:
    """The text of a list of content parts (``{"text": ...}``); a bare string as is."""
    if isinstance(parts, str):
        return text(parts)
    return text("".join(text(p.get("text", "")) for p in _sequence(parts) if isinstance(p, dict)))


def _drift(c: JsonObject, gym: JsonObject) -> JsonObject | None:
    """Where a completion's tokens drifted (model call and position), or None."""
    found = gym.get("token_drift") if c.get("token_drift") or gym.get("token_drift") else None
    if not found:
        return None
    where = _mapping(found)
    turn = number(where.get("turn"))
    return {"turn": turn if isinstance(turn, int) else None, "position": text(where.get("position"))}


def _step(step: object) -> JsonObject:
    """One trace step: an assistant turn's tokens and logprobs, or the text a prompt added."""
    fields = _mapping(step)
    role = text(fields.get("role"))
    if role != "assistant":
        return {"role": role, "text": text(fields.get("text", ""))}
    tokens = [text(t) for t in _sequence(fields.get("tokens"))]
    logprobs = fields.get("logprobs")
    checked = [number(lp) for lp in _sequence(logprobs)] if isinstance(logprobs, list) else None
    return {"role": role, "tokens": tokens, "logprobs": checked}


def _completion(c: JsonObject, detail: bool = True, line: int | None = None) -> JsonObject:
    """What the page shows of one completion: every value text, a checked number, a bool or None. Without
    ``detail``: what the table and the group's header show, and a note where the rest is (``line``)."""
    gym = _mapping(c.get("gym_result"))
    shown_part: JsonObject = {
        "reward": number(c.get("reward")),
        "termination": optional_text(c.get("termination")),
        "truncated": c.get("truncated") is True,
        "masked": c.get("masked") is True,
        "failure_kind": optional_text(c.get("failure_kind")),
        "drift": _drift(c, gym),
        "generated_tokens": number(c.get("generated_tokens")),
        "turns": number(c.get("turns")),
    }
    if not detail:
        note = f"[not embedded: report.html holds the traces of the first groups only; results.jsonl line {line}]"
        return {**shown_part, "trace": None, "text": note, "items": [], "grader": {}}
    trace = c.get("trace")
    return {
        **shown_part,
        "trace": [_step(step) for step in trace] if isinstance(trace, list) else None,
        "text": text(c.get("text", "")),
        "items": _items(gym.get("response")),
        "grader": {text(k): text(v) for k, v in gym.items() if k not in _HIDDEN_GYM_KEYS},
    }


def _prompt_text(record: JsonObject) -> str:
    """The last user message of the row's prompt (from the first completion's Gym result), as text."""
    completions = _sequence(record.get("completions"))
    first = _mapping(completions[0]) if completions else {}
    items = _mapping(_mapping(first.get("gym_result")).get("responses_create_params")).get("input")
    if isinstance(items, str):
        return text(items)
    users = [i.get("content") for i in _sequence(items) if isinstance(i, dict) and i.get("role") == "user"]
    return text(users[-1]) if users else ""


def _id(value: object) -> int | float | str | None:
    """An identifier shown on the page (prompt index, dataset line): a checked number, else text."""
    checked = number(value)
    return checked if checked is not None or value is None else text(value)


def _group(record: JsonObject, detail: bool = True, line: int | None = None) -> JsonObject:
    return {
        "idx": _id(record.get("prompt_idx")),
        "line": _id(record.get("line")),
        "row_id": optional_text(record.get("row_id")),
        "agent": text(record.get("agent") or ""),
        "prompt": _prompt_text(record) if detail else text(_prompt_text(record), 400),
        "completions": [_completion(_mapping(c), detail, line) for c in _sequence(record.get("completions"))],
    }


def _failure(f: JsonObject) -> JsonObject:
    failure: JsonObject = {k: optional_text(f.get(k)) for k in ("agent", "error", "class", "message")}
    return {**failure, "prompt_idx": _id(f.get("prompt_idx")), "line": _id(f.get("line"))}


def _threshold(run: JsonObject) -> float | int | str:
    """The run's pass threshold as a checked number (1.0 when it is missing or not a number)."""
    checked = number(_mapping(run.get("config")).get("pass_threshold", 1.0))
    return 1.0 if checked is None else checked


def _read_run_json(path: Path) -> JsonObject:
    """``run.json`` as an object (empty when missing, not JSON or not an object), read under the run-folder size
    cap (a FIFO or a device is refused: :class:`~gym_bridge.eval.runs.RunReadError`)."""
    raw = read_file(path, ReadLimits().max_run_json_bytes)
    try:
        run = loads(raw, str(path), max_depth=MAX_RUN_JSON_DEPTH) if raw is not None else {}
    except UntrustedInputError:
        return {}
    return run if isinstance(run, dict) else {}


@dataclass
class ViewerPage:
    """``report.html``'s data built one group at a time, each serialised as it comes: whole groups up to
    ``detail_bytes``, groups without their traces up to ``max_bytes``, later ones counted and left out."""

    detail_bytes: int = field(default_factory=lambda: MAX_DETAIL_BYTES)
    max_bytes: int = field(default_factory=lambda: MAX_PAGE_BYTES)
    groups: list[bytes] = field(default_factory=list)
    failures: list[bytes] = field(default_factory=list)
    size: int = 0
    whole: int = 0
    without_traces: int = 0
    left_out: int = 0
    failures_left_out: int = 0
    _done: set[object] = field(default_factory=set)

    def add_group(self, record: JsonObject, line: int | None = None) -> None:
        """One ``results.jsonl`` line (as read, any types), at ``line`` of the file."""
        self._done.add(_id(record.get("prompt_idx")))
        if self.size < self.detail_bytes:
            data = dumps(_group(record))
            if self.size + len(data) <= self.detail_bytes:
                self._keep(self.groups, data)
                self.whole += 1
                return
        data = dumps(_group(record, detail=False, line=line))
        if self.size + len(data) <= self.max_bytes:
            self._keep(self.groups, data)
            self.without_traces += 1
        else:
            self.left_out += 1

    def add_failure(self, record: JsonObject) -> None:
        """One ``failures.jsonl`` line (as read, any types); shown only when its prompt has no result."""
        data = dumps(_failure(record))
        if self.size + len(data) <= self.max_bytes:
            self._keep(self.failures, data)
        else:
            self.failures_left_out += 1

    def _keep(self, parts: list[bytes], data: bytes) -> None:
        parts.append(data)
        self.size += len(data) + 1

    def payload(self, run: JsonObject, run_dir: Path) -> bytes:
        """The page's data block: the run, the groups and the failures whose prompt has no result, as JSON."""
        info = {
            "dir": text(str(run_dir)),
            "model": optional_text(run.get("model")),
            "pass_threshold": _threshold(run),
            "prompts_total": _id(run.get("prompts_total")),
            "rescored_from": optional_text(_mapping(run.get("rescore")).get("source")),
        }
        failures = [f for f in self.failures if loads_object(f, "failure").get("prompt_idx") not in self._done]
        return b"".join(
            [b'{"run":', dumps(info), b',"groups":[', b",".join(self.groups), b'],"failures":[', b",".join(failures),
             b"]}"]
        )  # fmt: skip

    @property
    def summary(self) -> str:
        """What the page holds, in words, when it does not hold everything whole (else "")."""
        if not (self.without_traces or self.left_out or self.failures_left_out):
            return ""
        parts = [f"{self.whole:,} prompt groups whole"]
        if self.without_traces:
            parts.append(f"{self.without_traces:,} without their traces (results.jsonl holds them)")
        if self.left_out:
            parts.append(f"{self.left_out:,} left out")
        if self.failures_left_out:
            parts.append(f"{self.failures_left_out:,} failures left out")
        return (
            f"{VIEWER_FILE} holds {', '.join(parts)}: its data is bounded at {self.max_bytes / 2**20:.0f} MiB "
            f"(traces up to {self.detail_bytes / 2**20:.0f} MiB)"
        )


def read_viewer_page(run_dir: str | Path, page: ViewerPage | None = None) -> tuple[ViewerPage, JsonObject]:
    """The page's data of a run folder read from its files alone (streamed, values of any type), and
    ``run.json`` as read.

    Raises:
        RunReadError: a file is not regular, too large, or holds a line that is not a JSON object (named).
    """
    run_dir = Path(run_dir)
    page = page or ViewerPage()
    limits = ReadLimits.from_env()
    run = _read_run_json(run_dir / RUN_FILE)
    for number, _, _, record in iter_objects(run_dir / RESULTS_FILE, limits, finished=False):
        page.add_group(record, number)
    for _, _, _, record in iter_objects(run_dir / FAILURES_FILE, limits, finished=False):
        page.add_failure(record)
    return page, run


def viewer_data(run_dir: str | Path) -> JsonObject:
    """What the page shows, from the run folder's files alone, every value text or a checked number.

    Raises:
        RunReadError: see :func:`read_viewer_page`.
    """
    page, run = read_viewer_page(run_dir)
    return loads_object(page.payload(run, Path(run_dir)), "the viewer's page data")


def render_viewer(data: JsonObject) -> str:
    """The page: the template with ``data`` embedded as JSON and the CSP naming the page's script by hash
    (a non-finite float that reached ``data`` unchecked becomes the string ``"NaN"`` / ``"Infinity"``, never a
    bare ``NaN`` that ``JSON.parse`` refuses: a blank page)."""
    return page_bytes(dumps(_finite_json(data))).decode("utf-8")


def page_bytes(payload: bytes) -> bytes:
    """The page around the JSON ``payload``. Every ``<`` is escaped (``\\u003c``, inside JSON strings only: JSON
    has no ``<`` elsewhere), so no string can end the data block."""
    page = read_text(TEMPLATE, _TEMPLATE_MAX_BYTES)
    head, _, tail = page.replace(_HASH_MARK, script_hash(page), 1).partition(_DATA_MARK)
    return head.encode("utf-8") + payload.replace(b"<", b"\\u003c") + tail.encode("utf-8")


def _finite_json(value: object) -> object:
    """``value`` with every non-finite float replaced by its :func:`number` string (lists and dicts walked)."""
    if isinstance(value, float):
        return number(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def script_hash(page: str) -> str:
    """The CSP source (``'sha256-...'``) of the page's one executable inline script."""
    scripts = _SCRIPT.findall(page)
    if len(scripts) != 1:
        raise ValueError(f"the viewer template must hold exactly one executable script, found {len(scripts)}")
    digest = hashlib.sha256(scripts[0].encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def build_viewer(run_dir: str | Path) -> Path:
    """Write ``report.html`` into ``run_dir`` (atomically: a planted link is replaced); return its path.

    Raises:
        RunReadError: see :func:`read_viewer_page`.
    """
    page, run = read_viewer_page(run_dir)
    path = Path(run_dir) / VIEWER_FILE
    write_files({path: page_bytes(page.payload(run, Path(run_dir)))})
    return path
