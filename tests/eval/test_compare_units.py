"""``gym-bridge compare`` without Gym: the statistics against reference computations (an exact enumeration of
every bootstrap resample, scipy's bootstrap and binomial test), the comparison of hand-made run folders, and
every kind of bad input refused in one line with exit code 2 and nothing written."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from gym_bridge.cli import main
from gym_bridge.eval.compare import CompareError, compare_runs
from gym_bridge.eval.records import row_id
from gym_bridge.eval.runs import load_run
from gym_bridge.eval.store import RunStore
from gym_bridge.stats import mcnemar_exact, paired_bootstrap

# ---- statistics ------------------------------------------------------------------------------


def exact_percentile_interval(d: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval of the ideal bootstrap: all n^n equally likely resamples enumerated."""
    n = len(d)
    means = np.sort([d[list(pick)].mean() for pick in itertools.product(range(n), repeat=n)])

    def quantile(p: float) -> float:
        return float(means[math.ceil(p * len(means)) - 1])

    return quantile((1 - level) / 2), quantile((1 + level) / 2)


@pytest.mark.parametrize("level", [0.9, 0.95])
def test_bootstrap_interval_matches_exact_enumeration(level: float) -> None:
    d = np.array([0.3, -0.1, 0.5, 0.0, 0.9])
    low, high = exact_percentile_interval(d, level)
    interval = paired_bootstrap(d, level=level, resamples=200_000, seed=3)[0]
    assert interval.estimate == pytest.approx(d.mean())
    assert interval.low == pytest.approx(low, abs=0.021) and interval.high == pytest.approx(high, abs=0.021)


def test_bootstrap_interval_matches_scipy_percentile_bootstrap() -> None:
    from scipy.stats import bootstrap

    rng = np.random.default_rng(7)
    d = rng.normal(0.1, 1.0, 60)
    ours = paired_bootstrap(d, resamples=40_000, seed=0)[0]
    theirs = bootstrap((d,), np.mean, method="percentile", n_resamples=40_000, random_state=1).confidence_interval
    assert ours.low == pytest.approx(theirs.low, abs=0.02) and ours.high == pytest.approx(theirs.high, abs=0.02)


def test_bootstrap_is_seeded_and_paired_across_metrics() -> None:
    d = np.random.default_rng(0).normal(size=(2, 30))
    first = paired_bootstrap(d, seed=5)
    assert first == paired_bootstrap(d, seed=5), "same seed, same intervals"
    assert first != paired_bootstrap(d, seed=6)
    same = paired_bootstrap(np.vstack([d[0], d[0]]), seed=5)
    assert same[0] == same[1], "every metric sees the same resampled prompts"
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap(d, level=1.0)


def test_mcnemar_matches_scipys_binomial_test() -> None:
    from scipy.stats import binomtest

    rng = np.random.default_rng(1)
    for _ in range(20):
        before = (rng.random(50) < rng.random()).tolist()
        after = (rng.random(50) < rng.random()).tolist()
        result = mcnemar_exact(before, after)
        fixed = sum(not b and a for b, a in zip(before, after, strict=True))
        broken = sum(b and not a for b, a in zip(before, after, strict=True))
        assert (result.wrong_to_right, result.right_to_wrong) == (fixed, broken)
        expected = binomtest(broken, fixed + broken, 0.5).pvalue if fixed + broken else 1.0
        assert result.p_value == pytest.approx(expected, rel=1e-12)


def test_training_report_uses_the_same_mcnemar() -> None:
    import ast

    source = (Path(__file__).resolve().parents[2] / "benchmarks" / "train_demo_report.py").read_text()
    imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    assert any(n.module == "gym_bridge.stats" and any(a.name == "mcnemar_exact" for a in n.names) for n in imports)


# ---- run folders -----------------------------------------------------------------------------


def gym_row(i: int, agent: str = "math_agent") -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"question {i}"}]},
            "agent_ref": {"name": agent}, "expected_answer": str(i)}  # fmt: skip


def write_run(
    folder: Path,
    rewards: dict[int, list[float]],
    *,
    sha: str = "data-1",
    agent_of=lambda i: "math_agent" if i % 2 else "tool_agent",
    overrides: dict | None = None,
    extra: dict | None = None,
    order: list[int] | None = None,
) -> Path:
    """A finished run folder with one result line per prompt (``rewards``: prompt -> completion rewards)."""
    folder.mkdir(parents=True)
    fingerprint = {"dataset_sha256": sha, "config_paths": ["a.yaml"], "gym_overrides": overrides or {}}
    run = {"fingerprint": fingerprint, "config": {"pass_threshold": 1.0}, "model": folder.name, **(extra or {})}
    (folder / "run.json").write_text(json.dumps(run))
    lines = []
    for i in order or sorted(rewards):
        row = gym_row(i, agent_of(i))
        completions = [{"reward": r, "gym_result": {"responses_create_params": row["responses_create_params"]}}
                       for r in rewards[i]]  # fmt: skip
        lines.append(json.dumps({"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": row["agent_ref"]["name"],
                                 "completions": completions}))  # fmt: skip
    (folder / "results.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_row_id_is_canonical() -> None:
    a = {"x": 1, "y": [1, {"b": 2, "a": 1}]}
    b = json.loads('{"y": [1, {"a": 1, "b": 2}], "x": 1}')
    assert row_id(a) == row_id(b) and len(row_id(a)) == 16
    assert row_id(a) != row_id({**a, "x": 2})


def test_compare_finds_the_better_run_and_the_flips(tmp_path: Path) -> None:
    n = 40
    a = {i: [1.0, 1.0, 0.0, 0.0] if i % 4 == 0 else [0.0] * 4 for i in range(n)}
    b = {i: [1.0] * 4 if i < 30 else [0.0] * 4 for i in range(n)}
    run_a = write_run(tmp_path / "a", a)
    run_b = write_run(tmp_path / "b", b, order=list(reversed(range(n))))  # matched by row, not position
    outcome = compare_runs([run_a, run_b], tmp_path / "out", fail_if_worse=0.0)
    comparison = outcome.report["comparisons"][0]
    overall = comparison["agents"]["all"]
    assert overall["prompts"] == n and comparison["metrics"] == ["mean_reward", "pass@1", "pass@2", "pass@4"]
    mean = overall["metrics"]["mean_reward"]
    assert mean["a"] == pytest.approx(0.125) and mean["b"] == pytest.approx(0.75)
    assert mean["diff"] == pytest.approx(0.625) and 0 < mean["low"] < 0.625 < mean["high"]
    # verdict: pass@1 >= 0.5; A passes 0, 4, ..., 36; B passes 0..29
    fixed = sorted(f["prompt_idx"] for f in comparison["flips"] if f["direction"] == "fixed")
    broken = sorted(f["prompt_idx"] for f in comparison["flips"] if f["direction"] == "broken")
    assert fixed == [i for i in range(30) if i % 4] and broken == [32, 36]
    assert overall["mcnemar"]["fixed"] == len(fixed) and overall["mcnemar"]["broken"] == 2
    flip = next(f for f in comparison["flips"] if f["prompt_idx"] == 32)
    assert flip["rewards_a"] == [1.0, 1.0, 0.0, 0.0] and flip["rewards_b"] == [0.0] * 4 and flip["prompt"] == "question 32"
    assert set(comparison["agents"]) == {"math_agent", "tool_agent", "all"}
    assert outcome.worse == []
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "## b vs a" in md and "+0.625 [" in md and "question 32" in md
    assert json.loads((tmp_path / "out" / "compare.json").read_text()) == outcome.report
    assert (tmp_path / "out" / "compare.png").read_bytes()[:4] == b"\x89PNG"

    # The other way round B is worse: the gate trips (exit 1), and the outputs are still written.
    code = main(["compare", str(run_b), str(run_a), "--out", str(tmp_path / "gate"), "--fail-if-worse", "0.1"])
    assert code == 1 and (tmp_path / "gate" / "compare.md").exists()
    assert main(["compare", str(run_b), str(run_a), "--out", str(tmp_path / "gate"), "--fail-if-worse", "0.9"]) == 0


def test_repeated_rows_are_matched_by_occurrence(tmp_path: Path) -> None:
    same = lambda i: "math_agent"  # noqa: E731
    a = write_run(tmp_path / "a", {0: [1.0], 1: [0.0]}, agent_of=same)
    b = write_run(tmp_path / "b", {0: [0.0], 1: [1.0]}, agent_of=same)
    for run in (a, b):  # make row 1 a copy of row 0
        lines = (run / "results.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        second = {**json.loads(lines[1]), "row_id": first["row_id"]}
        (run / "results.jsonl").write_text(lines[0] + "\n" + json.dumps(second) + "\n")
    keys = [g.key for g in load_run(a).groups]
    assert keys[1] == keys[0] + "#1"
    report = compare_runs([a, b], tmp_path / "out").report
    assert report["shared_prompts"] == 2 and len(report["comparisons"][0]["flips"]) == 2


def test_three_runs_compare_with_the_first_over_shared_prompts(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {i: [0.0] for i in range(10)})
    b = write_run(tmp_path / "b", {i: [1.0] for i in range(10)})
    c = write_run(tmp_path / "c", {i: [1.0] for i in range(8)})  # same dataset, two prompts not finished
    report = compare_runs([a, b, c], tmp_path / "out").report
    assert report["shared_prompts"] == 8 and [r["not_shared"] for r in report["runs"]] == [2, 2, 0]
    assert [(c["a"], c["b"]) for c in report["comparisons"]] == [("a", "b"), ("a", "c")]


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------


def refused(capsys, tmp_path: Path, *runs: Path) -> str:
    out = tmp_path / "refused-out"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gym-bridge compare: ") and "\n" not in err, err
    assert not out.exists(), "nothing is written for bad input"
    return err


def test_bad_input_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    good = write_run(tmp_path / "good", {i: [1.0] for i in range(4)})
    assert f"{tmp_path / 'missing'}: no such run folder" in refused(capsys, tmp_path, good, tmp_path / "missing")

    other = write_run(tmp_path / "other", {i: [1.0] for i in range(2, 6)}, sha="data-2")
    err = refused(capsys, tmp_path, good, other)
    assert "other rows" in err and "results.jsonl:3" in err and "dataset_sha256" in err

    grader = write_run(tmp_path / "grader", {i: [1.0] for i in range(4)}, overrides={"judge": "strict"})
    assert "another grader config" in refused(capsys, tmp_path, good, grader)
    assert "gym_overrides" in refused(capsys, tmp_path, good, grader)

    bad = write_run(tmp_path / "bad", {i: [1.0] for i in range(4)})
    lines = (bad / "results.jsonl").read_text().splitlines()
    broken = json.loads(lines[2])
    del broken["completions"][0]["reward"]
    (bad / "results.jsonl").write_text("\n".join([*lines[:2], json.dumps(broken), lines[3]]) + "\n")
    err = refused(capsys, tmp_path, good, bad)
    assert f"{bad / 'results.jsonl'}:3: field 'completions[0].reward' is missing" in err

    (bad / "results.jsonl").write_text("\n".join([*lines[:2], "{not json", lines[3]]) + "\n")
    assert f"{bad / 'results.jsonl'}:3: not valid JSON" in refused(capsys, tmp_path, good, bad)

    (bad / "results.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:20])
    assert f"{bad / 'results.jsonl'}:5: torn last line" in refused(capsys, tmp_path, good, bad)

    no_ids = write_run(tmp_path / "old", {i: [1.0] for i in range(4)})
    text = (no_ids / "results.jsonl").read_text()
    (no_ids / "results.jsonl").write_text("\n".join(json.dumps({k: v for k, v in json.loads(line).items()
                                                                if k != "row_id"}) for line in text.splitlines()) + "\n")  # fmt: skip
    assert "results.jsonl:1: field 'row_id' is missing" in refused(capsys, tmp_path, good, no_ids)

    assert "run.json: missing" in refused(capsys, tmp_path, good, tmp_path)


def test_a_run_being_written_is_refused(tmp_path: Path, capsys) -> None:
    good = write_run(tmp_path / "good", {i: [1.0] for i in range(4)})
    store = RunStore(tmp_path / "live")
    store.open({"dataset_sha256": "data-1"}, resume=False)
    try:
        (tmp_path / "live" / "results.jsonl").write_text((good / "results.jsonl").read_text())
        assert "still being written" in refused(capsys, tmp_path, good, tmp_path / "live")
    finally:
        store.close()
    assert len(load_run(tmp_path / "live").groups) == 4, "readable once the writer has closed it"


def test_a_rescored_run_may_change_the_grader(tmp_path: Path) -> None:
    source = write_run(tmp_path / "source", {i: [1.0, 0.0] for i in range(6)})
    rescored = write_run(tmp_path / "rescored", {i: [1.0, 1.0] if i < 3 else [1.0, 0.0] for i in range(6)},
                         overrides={"judge": "lenient"}, extra={"rescore": {"source": str(source)}})  # fmt: skip
    report = compare_runs([source, rescored], tmp_path / "out").report
    assert report["comparisons"][0]["grader_change"] == {"gym_overrides": {"a": {}, "b": {"judge": "lenient"}}}
    assert "another grader" in (tmp_path / "out" / "compare.md").read_text()
    with pytest.raises(CompareError, match="at least two"):
        compare_runs([source], tmp_path / "x")
