"""Hostile run folders against the viewer and the Markdown reports, without a browser (issue 42): every value of
``report.html``'s data is text or a checked number whatever type the folder gave it, non-finite numbers travel
as their names, the page's CSP runs only its own script (by hash), and agent names, model names and error
messages cannot break a table or become markup in ``report.md`` / ``compare.md``.
The same payloads run in headless Chromium in ``test_viewer_browser.py``. The last section holds compare's own
hostile inputs: 200,000 prompts (linear McNemar, a bootstrap in bounded memory), three prompts (no claim, no
gate decision, the minimum checked by exact enumeration) and a non-finite ``--fail-if-worse``."""

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
from gym_bridge.eval.inert_text import markdown_text
from gym_bridge.eval.records import row_id
from gym_bridge.eval.report import build_report
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
    meta.update(model=XSS[0] + XSS[-1], prompts_total=XSS[2], rescore={"source": XSS[1]}, config=[XSS[4]])
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
    assert data["run"]["pass_threshold"] == 1.0 and data["run"]["rescored_from"] == XSS[1], "a config that is a list"


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
    for g, payload in zip(lines, [*XSS, r"$\frac{1}{$"], strict=True):
        g["agent"] = payload
    (run / "results.jsonl").write_text("".join(json.dumps(g) + "\n" for g in lines))
    meta = json.loads((run / "run.json").read_text())
    meta["model"] = XSS[0] + XSS[-1]
    meta["prompts_total"] = 10  # the failure below is the tenth prompt
    (run / "run.json").write_text(json.dumps(meta))
    failure = {"prompt_idx": 9, "line": 10, "agent": XSS[0], "error": XSS[-1], "class": "infra", "message": XSS[1]}
    (run / "failures.jsonl").write_text(json.dumps(failure) + "\n")
    build_report(run)
    md = (run / "report.md").read_text()
    assert_inert(md)
    rows = table_rows(md, "| agent |")
    assert len(rows) == 2 + len(XSS) + 2, "one row per agent (and all), none split by a newline"
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


@pytest.mark.parametrize("agent", [XSS[-1], XSS[0], XSS[6], r"_a $\frac{1}{$ b"])
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
    assert (tmp_path / "out" / "compare.png").stat().st_size > 1000, "mathtext in a name is drawn as text"


# ---- compare at scale and at small counts ------------------------------------------------------


def test_mcnemar_takes_linear_time_and_matches_the_binomial_test() -> None:
    import time

    from scipy.stats import binomtest

    from gym_bridge.stats import mcnemar_exact

    before = [i % 2 == 0 for i in range(200_000)]
    after = [i % 4 < 2 for i in range(200_000)]
    started = time.process_time()
    result = mcnemar_exact(before, after)
    assert time.process_time() - started < 10.0, "a liveness bound: the big-integer sum took minutes here"
    assert (result.wrong_to_right, result.right_to_wrong) == (50_000, 50_000) and result.p_value == 1.0
    for fixed, broken in ((9_000, 11_000), (3, 0), (40, 12)):
        got = mcnemar_exact([False] * fixed + [True] * broken, [True] * fixed + [False] * broken).p_value
        assert got == pytest.approx(binomtest(broken, fixed + broken, 0.5).pvalue, rel=1e-9)


@pytest.mark.parametrize("distinct", ["few", "many"])
def test_the_bootstrap_runs_in_bounded_memory(distinct: str) -> None:
    import tracemalloc

    import numpy as np

    from gym_bridge.stats import paired_bootstrap

    rng = np.random.default_rng(0)
    prompts = 200_000
    data = rng.integers(-1, 2, (3, prompts)).astype(float) if distinct == "few" else rng.normal(size=(1, prompts))
    tracemalloc.start()
    intervals = paired_bootstrap(data, resamples=100 if distinct == "many" else 10_000, seed=1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 256 << 20, f"peak {peak >> 20} MiB: picks are drawn in bounded chunks"
    assert all(iv.low <= iv.estimate <= iv.high for iv in intervals)


def false_claim_rate(n: int, discordant: float, resamples: int = 2_000) -> float:
    """P(the percentile interval excludes 0) under "no difference", by exact enumeration of every outcome of ``n``
    paired prompts whose difference is +1 or -1 with probability ``discordant / 2`` each, else 0."""
    import numpy as np

    from gym_bridge.stats import paired_bootstrap

    total = 0.0
    for up in range(n + 1):
        for down in range(n + 1 - up):
            same = n - up - down
            if discordant == 1.0 and same:
                continue
            log_p = math.lgamma(n + 1) - math.lgamma(up + 1) - math.lgamma(down + 1) - math.lgamma(same + 1)
            log_p += (up + down) * math.log(discordant / 2) + (same * math.log(1 - discordant) if same else 0.0)
            d = np.array([1.0] * up + [-1.0] * down + [0.0] * same)
            interval = paired_bootstrap(d, resamples=resamples, seed=0)[0]
            total += math.exp(log_p) * (interval.low > 0 or interval.high < 0)
    return total


def test_the_minimum_of_paired_prompts_holds_by_exact_enumeration() -> None:
    from gym_bridge.stats import MIN_PAIRED_PROMPTS

    assert false_claim_rate(3, 1.0) == pytest.approx(0.25), "3 prompts: a 95 % interval claims a change 1 in 4"
    worst = max(false_claim_rate(MIN_PAIRED_PROMPTS, q) for q in (0.2, 0.5, 0.7, 0.9, 1.0))
    assert worst < 0.08, f"at {MIN_PAIRED_PROMPTS} paired prompts the 95 % interval claims falsely {worst:.3f}"


def test_below_the_minimum_nothing_is_claimed_or_gated(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {i: 1.0 for i in range(3)}, "agent", "model a")
    b = write_run(tmp_path / "b", {i: 0.0 for i in range(3)}, "agent", "model b")
    outcome = compare_runs([a, b], tmp_path / "out", fail_if_worse=0.0)
    overall = outcome.report["comparisons"][0]["agents"]["all"]
    assert overall["metrics"]["mean_reward"]["high"] < 0 and overall["claims"] is False
    assert outcome.worse == [] and len(outcome.undecided) == 1 and "3 paired prompts" in outcome.undecided[0]
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "▼" not in md.split("## ", 2)[2] and "no decision: 3 paired prompts" in md


@pytest.mark.parametrize("delta", ["nan", "inf", "-inf"])
def test_a_non_finite_gate_is_refused_in_one_line(tmp_path: Path, delta: str, capsys) -> None:
    from gym_bridge.cli import main

    a = write_run(tmp_path / "a", {i: 1.0 for i in range(12)}, "agent", "model a")
    b = write_run(tmp_path / "b", {i: 0.0 for i in range(12)}, "agent", "model b")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "out"), f"--fail-if-worse={delta}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gym-bridge compare: ") and "\n" not in err and "finite" in err
    assert not (tmp_path / "out").exists()


def test_many_distinct_outcomes_at_scale_take_the_expansion_of_the_same_bootstrap() -> None:
    import time

    import numpy as np

    from gym_bridge.stats import EXPANDED, RESAMPLED, _chunked_means, cornish_fisher_interval, paired_bootstrap

    rng = np.random.default_rng(3)
    x = np.minimum(rng.exponential(0.1, 12_000), 1.0) - np.minimum(rng.exponential(0.09, 12_000), 1.0)
    expanded = cornish_fisher_interval(x, 0.95)
    means = _chunked_means(x[None, :], 8_000, np.random.default_rng(0))[:, 0]
    low, high = np.quantile(means, [0.025, 0.975])
    se = float(x.std()) / math.sqrt(len(x))
    assert abs(expanded.low - low) < 0.1 * se and abs(expanded.high - high) < 0.1 * se, "within resampling error"
    big = rng.beta(0.5, 3, 200_000) - rng.beta(0.6, 3, 200_000)
    started = time.process_time()
    intervals = paired_bootstrap(np.vstack([big, big > 0]), seed=0)
    assert time.process_time() - started < 30.0, "a liveness bound: resampling it took minutes"
    assert [iv.method for iv in intervals] == [EXPANDED, EXPANDED], "one paired method for every row"
    assert paired_bootstrap(np.vstack([big > 0, big < 0]), seed=0)[0].method == RESAMPLED, "few outcomes: resampled"
