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
    run = synthetic_run(tmp_path_factory.mktemp("viewer") / "run", PROMPTS, N, skill=0.6)
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
