"""The trace viewer (``report.html``) in a real headless Chromium, driven through chromedriver: the page loads
with no console error, each filter and a sort change the rows shown, a prompt group opens and a completion
expands into its turns with shaded tokens, and the drift / truncation markers appear where the data has them.

Needs Debian's ``chromium`` and ``chromium-driver``; without them the test fails saying so (``make test-browser``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from viewer_support import MISSING, Chromium, synthetic_run

from gym_bridge.eval.report import build_report

pytestmark = [pytest.mark.browser, pytest.mark.e2e]
PROMPTS, N = 300, 4


@pytest.fixture(scope="module")
def browser():
    try:
        chromium = Chromium()
    except RuntimeError as exc:
        if MISSING in str(exc):
            pytest.fail(MISSING)  # never a skip: a browser test that did not run did not pass
        raise
    yield chromium
    chromium.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    run = synthetic_run(tmp_path_factory.mktemp("viewer") / "run", PROMPTS, N, skill=0.6, prompts_total=PROMPTS + 1)
    failure = {"prompt_idx": PROMPTS, "line": PROMPTS + 1, "agent": "lc_equivalence_rule_simple_agent",
               "error": "RolloutTimeout", "message": "the group's deadline of 600 s expired", "class": "infra"}  # fmt: skip
    (run / "failures.jsonl").write_text(json.dumps(failure) + "\n")
    build_report(run)
    return run / "report.html"


def shown(browser: Chromium) -> list[dict]:
    """The rows in the DOM (the table renders only those near the view), as the cells show them."""
    return browser.run("""return [...document.querySelectorAll('#spacer .row')].map(r => {
        const c = r.children; return {idx: +c[0].textContent, agent: c[1].textContent, mean: +c[4].textContent,
                                   pass: c[5].textContent, flags: c[7].textContent}; });""")


def count(browser: Chromium) -> str:
    return browser.run("return document.getElementById('count').textContent")


def choose(browser: Chromium, select: str, value: str) -> None:
    browser.click(f"#{select} option[value='{value}']")


def test_viewer_loads_filters_sorts_and_expands(browser: Chromium, page: Path, tmp_path: Path) -> None:
    browser.open(page.as_uri())
    state = browser.run("return window.gymBridgeViewer")
    assert state["groups"] == PROMPTS + 1 and state["completions"] == PROMPTS * N, "a failed group is a row too"
    errors = [e for e in browser.console() if e.get("level") in ("SEVERE", "ERROR")]
    assert not errors, errors
    total = PROMPTS + 1
    assert count(browser) == f"{total} of {total} groups"
    rows = shown(browser)
    assert 10 < len(rows) < PROMPTS, "only the rows near the view are rendered"
    assert [r["idx"] for r in rows[:5]] == [0, 1, 2, 3, 4]

    choose(browser, "f-agent", "lc_equivalence_rule_simple_agent")
    assert count(browser) == f"{PROMPTS // 3 + 1} of {total} groups"
    assert {r["agent"] for r in shown(browser)} == {"lc_equivalence_rule_simple_agent"}
    choose(browser, "f-verdict", "fail")
    failed = shown(browser)
    assert failed and all(r["pass"].startswith("0.00") for r in failed)
    assert PROMPTS in [r["idx"] for r in failed], "a failed group passed nothing"
    choose(browser, "f-verdict", "pass")
    assert shown(browser) and all(r["pass"].startswith("1.00") for r in shown(browser))
    choose(browser, "f-agent", "")
    choose(browser, "f-verdict", "")
    choose(browser, "f-term", "failed: RolloutTimeout")
    assert [r["idx"] for r in shown(browser)] == [PROMPTS]
    browser.click("#spacer .row")
    assert "deadline of 600 s expired" in browser.run("return document.getElementById('detail').textContent")
    choose(browser, "f-term", "")
    browser.type("#f-text", "question 123:")
    assert [r["idx"] for r in shown(browser)] == [123]
    browser.run("const t = document.getElementById('f-text'); t.value = ''; t.dispatchEvent(new Event('input'));")

    browser.click(".cols span[data-sort='mean']")
    browser.click(".cols span[data-sort='mean']")  # second click: descending
    means = [r["mean"] for r in shown(browser)]
    assert means == sorted(means, reverse=True) and means[0] == 1.0

    choose(browser, "f-flag", "drift")
    drifted = shown(browser)
    assert drifted and all("D" in r["flags"] for r in drifted)
    browser.click("#spacer .row")
    assert browser.run("return document.querySelectorAll('#detail .completion').length") == N
    assert browser.run("return document.querySelectorAll('.completion.open').length") == 0
    for k in range(N):
        browser.click(f".completion[data-k='{k}'] .head")
    opened = browser.run("""return [...document.querySelectorAll('.completion.open')].map(c => ({
        tokens: c.querySelectorAll('.gen span[title^="logprob"]').length,
        shaded: [...c.querySelectorAll('.gen span[title^="logprob"]')].filter(s => s.style.background).length,
        drift: c.querySelectorAll('.marker.drift').length, grader: c.querySelector('table.kv') !== null}));""")
    assert len(opened) == N and all(o["tokens"] > 5 and o["shaded"] == o["tokens"] and o["grader"] for o in opened)
    assert sum(o["drift"] for o in opened) >= 1, "the drifted completion marks where the drift is"

    choose(browser, "f-flag", "truncated")
    browser.click("#spacer .row")
    for k in range(N):
        browser.click(f".completion[data-k='{k}'] .head")
    assert browser.run("return document.querySelectorAll('.completion.open .marker').length") >= 1

    assert not [e for e in browser.console() if e.get("level") in ("SEVERE", "ERROR")]
    shot = tmp_path / "viewer.png"
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# ---- hostile run folders (issue 42) ------------------------------------------------------------


def alert_open(browser: Chromium) -> str | None:
    """The text of an open alert, or None when no script of a payload opened one."""
    try:
        return str(browser._call("GET", browser._s("/alert/text")))
    except RuntimeError as exc:
        if "no such alert" in str(exc):
            return None
        raise


def hostile_page(folder: Path, *, non_finite: bool = False) -> Path:
    """``report.html`` of a run with payloads in every field (type-confused ones too) and failed groups."""
    from test_hostile_viewer import XSS, confuse

    from gym_bridge.eval.viewer import render_viewer, viewer_data

    run = synthetic_run(folder, 12, 3, skill=0.5)
    confuse(run)
    failures = [{"prompt_idx": 100 + i, "line": payload, "agent": payload, "error": payload, "class": [payload],
                 "message": payload} for i, payload in enumerate(XSS)]  # fmt: skip
    (run / "failures.jsonl").write_text("".join(json.dumps(f) + "\n" for f in failures))
    data = viewer_data(run)
    if non_finite:
        first = data["groups"][0]["completions"]
        first[0]["reward"], first[1]["reward"], first[2]["generated_tokens"] = float("nan"), float("inf"), float("-inf")
        step = next(s for s in first[0]["trace"] if s["role"] == "assistant")
        step["logprobs"][2] = float("nan")
    page = run / "report.html"
    page.write_text(render_viewer(data))
    return page


MARKUP = ", ".join(f"{box} {tag}" for box in ("#spacer", "#detail") for tag in ("img", "svg", "script", "iframe"))
MARKUP += ", [onerror], [onload], [onmouseover]"


def open_everything(browser: Chromium) -> int:
    """Click every row and open every completion of it; return how many completions were opened."""
    opened = 0
    rows = browser.run("return document.querySelectorAll('#spacer .row').length")
    for k in range(rows):
        browser.run(f"document.querySelectorAll('#spacer .row')[{k}].click()")
        heads = browser.run("return document.querySelectorAll('#detail .completion > .head').length")
        for j in range(heads):
            browser.run(f"document.querySelectorAll('#detail .completion > .head')[{j}].click()")
            browser.run(
                "for (const s of document.querySelectorAll('#detail [title]')) "
                "s.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));"
            )
            opened += 1
        assert alert_open(browser) is None, f"a payload ran in row {k}"
    return opened


def test_payloads_in_every_field_render_as_text(browser: Chromium, tmp_path: Path) -> None:
    from test_hostile_viewer import XSS

    page = hostile_page(tmp_path / "run")
    browser.open(page.as_uri())
    state = browser.run("return window.gymBridgeViewer")
    assert state["groups"] == 12 + len(XSS), "every group and failed group is a row: the page is not blank"
    assert open_everything(browser) == 12 * 3
    assert alert_open(browser) is None
    assert browser.run(f"return document.querySelectorAll({json.dumps(MARKUP)}).length") == 0
    browser.run("document.querySelectorAll('#spacer .row')[0].click();"
                "document.querySelector('#detail .completion > .head').click();")  # fmt: skip
    titles = browser.run("return [...document.querySelectorAll('#detail .gen span')].map(s => s.title)")
    assert titles[:2] == ["logprob n/a", "logprob n/a"], "a string logprob is not a number, and never markup"
    detail = browser.run("return document.getElementById('detail').textContent")
    assert XSS[0] in detail, "the payload is shown, as text"
    console = browser.console()
    assert not [e for e in console if "Content Security Policy" in e.get("message", "")], console


def test_non_finite_numbers_are_shown_as_such(browser: Chromium, tmp_path: Path) -> None:
    page = hostile_page(tmp_path / "run", non_finite=True)
    browser.open(page.as_uri())
    assert browser.run("return window.gymBridgeViewer.completions") == 12 * 3
    browser.run("document.querySelectorAll('#spacer .row')[0].click()")
    heads = browser.run("return [...document.querySelectorAll('#detail .completion > .head')].map(h => h.textContent)")
    assert "reward NaN" in heads[0] and "reward Infinity" in heads[1] and "-Infinity generated tokens" in heads[2]
    assert "NaN" in browser.run("return document.querySelector('#spacer .row').children[4].textContent")
    browser.run("document.querySelector('#detail .completion > .head').click()")
    titles = browser.run("return [...document.querySelectorAll('#detail .gen span')].map(s => s.title)")
    assert titles[2] == "logprob NaN"
    assert not [e for e in browser.console() if e.get("level") in ("SEVERE", "ERROR")]


def test_the_csp_blocks_injected_markup_and_runs_the_page(browser: Chromium, tmp_path: Path) -> None:
    page = hostile_page(tmp_path / "run")
    html = page.read_text()
    assert "'unsafe-inline'" not in html.split("script-src", 1)[1].split(";", 1)[0]
    browser.open(page.as_uri())
    assert browser.run("return typeof window.gymBridgeViewer") == "object", "the page's own script runs (by hash)"
    browser.run("document.body.insertAdjacentHTML('beforeend', "
                "'<img src=\"data:,\" onerror=\"window.injected = 1\" onload=\"window.injected = 1\">"
                "<a id=\"js\" href=\"javascript:window.injected = 2\">x</a>');"
                "const s = document.createElement('script'); s.textContent = 'window.injected = 3';"
                "document.body.appendChild(s); document.getElementById('js').click();")  # fmt: skip
    assert browser.run("return window.injected === undefined"), "no injected handler, URL or script runs"
    assert alert_open(browser) is None
