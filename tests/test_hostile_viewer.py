"""Hostile run folders against the viewer and the Markdown reports, without a browser (issue 42): every value of
``report.html``'s data is text or a checked number whatever type the folder gave it, non-finite numbers travel
as their names, the page's CSP runs only its own script (by hash), and agent names, model names and error
messages cannot break a table or become markup in ``report.md`` / ``compare.md``.
The same payloads run in headless Chromium in ``test_viewer_browser.py``."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from pathlib import Path

import pytest
from viewer_support import synthetic_run

from gym_bridge.eval.compare import compare_runs
from gym_bridge.eval.records import row_id
from gym_bridge.eval.report import build_report, markdown_text
from gym_bridge.eval.viewer import number, render_viewer, script_hash, text, viewer_data

XSS = [
    '"><img src=x onerror=alert(1)>',
    "</script><script>alert(2)</script>",
    "' onmouseover='alert(3)",
    "`${alert(4)}`",
    "<svg/onload=alert(5)>",
    "javascript:alert(6)",
    "[click](javascript:alert(7)) ![i](http://example.invalid/x.png)",
    "a|b\nc\r\n| d |\u2028e\u0085f",
]
NON_FINITE_NAMES = {"NaN", "Infinity", "-Infinity"}
NUMERIC = {"reward", "generated_tokens", "turns", "pass_threshold", "logprobs"}


def confuse(run: Path) -> None:
    """Rewrite the first groups of a synthetic run with payloads in every field and wrong types in many."""
    lines = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    for g, payload in zip(lines, XSS, strict=False):
        g["agent"] = payload
        g["row_id"] = payload
        c = g["completions"][0]
        c.update(termination=payload, failure_kind=payload, text=payload)
        step = next(s for s in c["trace"] if s["role"] == "assistant")
        step["tokens"][0] = payload
        step["logprobs"][0] = payload  # a logprob that is a string
        step["logprobs"][1] = {"x": payload}
        c["trace"][0]["text"] = payload
        gym = c["gym_result"]
        gym["extracted_answer"] = payload
        gym["responses_create_params"]["input"][0]["content"] = payload
        gym["response"]["output"].append({"type": "function_call", "name": payload, "arguments": {"a": payload}})
    wrong = lines[-1]["completions"]
    wrong[0].update(reward="1.0", turns=[payload], generated_tokens={"n": 1}, trace=payload, truncated="yes")
    wrong[1].update(trace=[{"role": "assistant", "tokens": payload, "logprobs": payload}, 7, None])
    wrong[2]["gym_result"] = {"response": {"output": payload}, "token_drift": {"turn": payload, "position": payload}}
    wrong[2]["token_drift"] = True
    (run / "results.jsonl").write_text("".join(json.dumps(g) + "\n" for g in lines))
    meta = json.loads((run / "run.json").read_text())
    meta["model"] = XSS[0] + XSS[-1]
    (run / "run.json").write_text(json.dumps(meta))


def leaves(value: object, path: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in leaves(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [leaf for v in value for leaf in leaves(v, f"{path}[]")]
    return [(path, value)]


def checked(path: str, value: object) -> bool:
    """Text, a bool, None, a finite number, or (in a numeric field) the name of a non-finite one."""
    if value is None or isinstance(value, (str, bool)):
        return not (isinstance(value, str) and path.rsplit(".", 1)[-1].rstrip("[]") in NUMERIC) or (
            value in NON_FINITE_NAMES
        )
    return isinstance(value, (int, float)) and math.isfinite(value)


def embedded(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S)
    assert match
    return json.loads(match.group(1))


def test_every_value_is_text_or_a_checked_number(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", 12, 3)
    confuse(run)
    data = viewer_data(run)
    bad = [(path, value) for path, value in leaves(data) if not checked(path, value)]
    assert not bad, bad[:5]
    first = data["groups"][0]["completions"][0]
    step = next(s for s in first["trace"] if s["role"] == "assistant")
    assert step["logprobs"][:2] == [None, None], "a string or an object is not a logprob"
    assert step["tokens"][0] == XSS[0] and first["text"] == XSS[0], "model text is kept, as text"
    wrong = data["groups"][-1]["completions"]
    assert wrong[0]["reward"] is None and wrong[0]["trace"] is None and wrong[0]["truncated"] is False
    assert wrong[1]["trace"][0] == {"role": "assistant", "tokens": [], "logprobs": None}
    assert wrong[2]["drift"] == {"turn": None, "position": XSS[-1]} and wrong[2]["items"] == []


def test_numbers_are_checked() -> None:
    assert [number(v) for v in (1, 0.5, True, "1", None, [1])] == [1, 0.5, None, None, None, None]
    assert [number(v) for v in (math.nan, math.inf, -math.inf)] == ["NaN", "Infinity", "-Infinity"]
    assert text({"a": [1, math.nan]}) == '{"a": [1, NaN]}' and text("x" * 10, limit=4).startswith("xxxx... [cut")


def test_non_finite_numbers_never_make_the_data_unreadable(tmp_path: Path) -> None:
    data = viewer_data(synthetic_run(tmp_path / "run", 2, 2))
    c = data["groups"][0]["completions"][0]
    c["reward"], c["generated_tokens"] = math.nan, math.inf
    data["run"]["pass_threshold"] = -math.inf
    html = render_viewer(data)
    back = embedded(html)  # strict JSON: a bare NaN would make JSON.parse fail and the page blank
    assert back["groups"][0]["completions"][0]["reward"] == "NaN" and back["run"]["pass_threshold"] == "-Infinity"
    assert "NaN," not in html.replace('"NaN"', "")


def test_the_page_runs_only_its_own_script(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", 3, 3)
    confuse(run)
    html = render_viewer(viewer_data(run))
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', html)
    assert csp
    directives = {d.split()[0]: d.split()[1:] for d in csp.group(1).split(";") if d.strip()}
    script = re.search(r"<script>(.*?)</script>", html, re.S)
    assert script and html.count("<script>") == 1
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    assert directives["script-src"] == [f"'sha256-{digest}'"] == [script_hash(html)]
    assert directives["base-uri"] == ["'none'"] and directives["form-action"] == ["'none'"]
    assert directives["default-src"] == ["'none'"] and "'unsafe-inline'" not in directives["script-src"]
    for payload in XSS:
        assert payload not in html or "<" not in payload, "no payload with markup appears raw in the page"
    assert "alert(2)</script>" not in html


# ---- Markdown --------------------------------------------------------------------------------


def table_rows(markdown: str, header_start: str) -> list[str]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def cells(row: str) -> int:
    """The number of cells GFM sees in a table row: unescaped pipes, less the outer two, plus one."""
    return len(re.findall(r"(?<!\\)\|", row)) - 1


def assert_inert(markdown: str) -> None:
    assert "<img" not in markdown and "<svg" not in markdown and "<script" not in markdown
    assert "](javascript" not in markdown and "![i](" not in markdown
    assert "\u2028" not in markdown and "\u0085" not in markdown


def test_markdown_text_is_inert_on_one_line() -> None:
    for payload in XSS:
        out = markdown_text(payload)
        assert "\n" not in out and "\r" not in out and cells(f"| {out} |") == 1, out
        assert_inert(out)


def test_report_md_escapes_agents_models_and_errors(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", 9, 2)
    lines = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    for g, payload in zip(lines, XSS, strict=False):
        g["agent"] = payload
    (run / "results.jsonl").write_text("".join(json.dumps(g) + "\n" for g in lines))
    meta = json.loads((run / "run.json").read_text())
    meta["model"] = XSS[0] + XSS[-1]
    (run / "run.json").write_text(json.dumps(meta))
    failure = {"prompt_idx": 9, "line": 10, "agent": XSS[0], "error": XSS[-1], "class": "infra", "message": XSS[1]}
    (run / "failures.jsonl").write_text(json.dumps(failure) + "\n")
    build_report(run)
    md = (run / "report.md").read_text()
    assert_inert(md)
    rows = table_rows(md, "| agent |")
    assert len(rows) == 2 + len(XSS) + 2, "one row per agent (and the ninth prompt's own, and all), none split"
    assert len({cells(row) for row in rows}) == 1, "no '|' in a name adds a column"
    failures = table_rows(md, "| error |")
    assert len(failures) == 3 and len({cells(row) for row in failures}) == 1


def write_run(folder: Path, rewards: dict[int, float], agent: str, model: str) -> Path:
    """A finished run folder of one completion per prompt, every prompt of ``agent``."""
    folder.mkdir(parents=True)
    run = {"fingerprint": {"dataset_sha256": "d", "config_paths": ["a.yaml"], "gym_overrides": {}},
           "config": {"pass_threshold": 1.0}, "model": model}  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run))
    with (folder / "results.jsonl").open("w") as f:
        for i, reward in rewards.items():
            row = {"responses_create_params": {"input": [{"role": "user", "content": f"{XSS[i % len(XSS)]} {i}"}]},
                   "agent_ref": {"name": agent}}  # fmt: skip
            completion = {"reward": reward, "gym_result": {"responses_create_params": row["responses_create_params"]}}
            line = {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": agent, "completions": [completion]}
            f.write(json.dumps(line) + "\n")
    return folder


@pytest.mark.parametrize("agent", [XSS[-1], XSS[0], XSS[6]])
def test_compare_md_escapes_agents_models_and_prompts(tmp_path: Path, agent: str) -> None:
    a = write_run(tmp_path / "a", {i: 0.0 for i in range(20)}, agent, XSS[0])
    b = write_run(tmp_path / "b", {i: float(i < 15) for i in range(20)}, agent, XSS[-1])
    compare_runs([a, b], tmp_path / "out")
    md = (tmp_path / "out" / "compare.md").read_text()
    assert_inert(md)
    rows = table_rows(md, "| agent |")
    assert len(rows) == 4 and len({cells(row) for row in rows}) == 1, rows
    flips = table_rows(md, "| flip |")
    assert len(flips) == 2 + 15 and len({cells(row) for row in flips}) == 1
