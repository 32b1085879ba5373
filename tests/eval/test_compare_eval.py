"""One real ``gym-bridge eval`` of two policies (``examples/eval_two_policies.yaml``: real Ray, real Gym servers,
the embedded random tiny model and the scripted policy), then everything that reads or repeats those runs:
the comparison the command writes and ``compare`` (the scripted policy beats the tiny model, with an interval
above 0, on exactly the prompts it answers), ``rescore`` (Gym's own /verify again under another grading rule
changes exactly the rewards that rule changes), the seed (the tiny model's run repeated alone, one group at a
time, gives the same completions token for token) and ``--resume`` per policy. The runs are made once for the
module. The commands join the evals' shared Ray (``eval_ray_env``; the two-policy command joins it once for both
policies) and each policy starts its own Gym set; tests/eval/test_eval_run.py runs the command with a Ray of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from difflib import SequenceMatcher
from pathlib import Path

import pytest

from gym_bridge.eval.runs import load_run
from gym_bridge.eval.store import read_jsonl
from gym_bridge.testing.cli import run_cli
from gym_bridge.testing.gym_rows import equivalence_row

REPO = Path(__file__).resolve().parents[2]
TWO_POLICIES = REPO / "examples" / "eval_two_policies.yaml"
ONE_POLICY = REPO / "examples" / "eval_equivalence_tools.yaml"
ROWS = REPO / "examples" / "data" / "gym_rows.jsonl"
N = 2
WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord")
PROMPTS = 12
"""The example's six rows and six more equivalence rows: graders that tell the policies apart on every Gym
version (nemo-gym 0.5.1's tool-call verifier rewards the random model too, so six rows leave the interval at 0)."""


def dataset(folder: Path) -> Path:
    """The test's dataset: the example rows, then one "Reply with exactly" row per word."""
    path = folder / "rows.jsonl"
    extra = [equivalence_row(f"Reply with exactly: {word}", word) for word in WORDS]
    path.write_text(ROWS.read_text().rstrip("\n") + "\n" + "".join(json.dumps(row) + "\n" for row in extra))
    return path


pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow]


def cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in this repository; with ``env`` (``eval_ray_env``) it joins that Ray, else starts its own."""
    env = env or {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    return run_cli(*args, cwd=REPO, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, eval_ray_env: dict[str, str]) -> dict[str, Path]:
    """``examples/eval_two_policies.yaml`` in one command: the tiny model, then the scripted policy."""
    root = tmp_path_factory.mktemp("two-policies")
    rows = dataset(tmp_path_factory.mktemp("dataset"))
    done = cli("eval", str(TWO_POLICIES), f"output_dir={root}", f"dataset={rows}", "--no-progress", env=eval_ray_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Ray started once" in done.stdout
    return {"root": root, "tiny": root / "tiny", "scripted": root / "scripted", "dataset": rows}


def last_session(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["sessions"][-1]


def generated_tokens(run: Path) -> dict[int, list[list[str]]]:
    """Each prompt's completions as their generated token lists (from the traces the eval records)."""
    return {
        line["prompt_idx"]: [
            [token for turn in c["trace"] if turn["role"] == "assistant" for token in turn["tokens"]]
            for c in line["completions"]
        ]
        for line in read_jsonl(run / "results.jsonl")
    }


def test_the_command_writes_a_run_per_policy_and_their_comparison(runs: dict[str, Path]) -> None:
    for policy in ("tiny", "scripted"):
        assert len(read_jsonl(runs[policy] / "results.jsonl")) == PROMPTS and (runs[policy] / "report.md").exists()
        assert last_session(runs[policy])["outcome"] == "finished"
    report = json.loads((runs["root"] / "compare.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["tiny", "scripted"] and report["baseline"] == "tiny"
    assert report["shared_prompts"] == PROMPTS and (runs["root"] / "compare.png").exists()
    overall = report["comparisons"][0]["agents"]["all"]["metrics"]
    assert overall["mean_reward"]["low"] > 0 and overall["pass@1"]["low"] > 0, "the scripted policy wins"


def verdicts(run: Path) -> dict[int, bool]:
    """Each prompt's verdict as compare defines it: at least half of its completions have reward 1."""
    return {g.prompt_idx: sum(r >= 1.0 for r in g.rewards) >= len(g.rewards) / 2 for g in load_run(run).groups}


@pytest.mark.timeout(900)
def test_scripted_beats_tiny_with_an_interval_above_zero(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    done = cli("compare", str(runs["tiny"]), str(runs["scripted"]), "--out", str(out), "--fail-if-worse", "0")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "compare.json").read_text())
    assert report["shared_prompts"] == PROMPTS
    comparison = report["comparisons"][0]
    overall = comparison["agents"]["all"]["metrics"]
    assert overall["mean_reward"]["low"] > 0 and overall["pass@1"]["low"] > 0, overall

    tiny, scripted = verdicts(runs["tiny"]), verdicts(runs["scripted"])
    assert sum(scripted.values()) == PROMPTS - 1, "the scripted policy answers all but the open question"
    expected_fixed = sorted(i for i in scripted if scripted[i] and not tiny[i])
    expected_broken = sorted(i for i in scripted if tiny[i] and not scripted[i])
    flips = comparison["flips"]
    assert sorted(f["prompt_idx"] for f in flips if f["direction"] == "fixed") == expected_fixed
    assert sorted(f["prompt_idx"] for f in flips if f["direction"] == "broken") == expected_broken
    assert len(expected_fixed) >= 8
    assert all(len(f["rewards_a"]) == len(f["rewards_b"]) == N for f in flips)
    assert "Reply with exactly: 42" in (out / "compare.md").read_text()

    # The gate: scripted -> tiny is worse by more than 0.2 at 95 %.
    gated = cli("compare", str(runs["scripted"]), str(runs["tiny"]), "--out", str(tmp_path / "gate"),
                "--fail-if-worse", "0.2")  # fmt: skip
    assert gated.returncode == 1 and "worse by more than 0.2" in gated.stderr


def output_text(gym_result: dict) -> str:
    """The text equivalence_rule grades: every output_text block of the response's messages."""
    return "".join(part["text"] for item in gym_result["response"]["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")  # fmt: skip


@pytest.mark.timeout(900)
def test_rescore_with_another_grading_rule_changes_exactly_its_rewards(runs: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(runs["scripted"], source)
    lines = (source / "results.jsonl").read_text().splitlines()
    broken = json.loads(lines[0])
    del broken["completions"][1]["gym_result"]["response"]  # a stored result that cannot be verified again
    (source / "results.jsonl").write_text("\n".join([json.dumps(broken), *lines[1:]]) + "\n")
    out = tmp_path / "rescored"
    done = cli("rescore", str(source), "--out", str(out),
               "gym_overrides.lc_equivalence_rule.resources_servers.equivalence_rule.grading_rule=seq_match")  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "1 could not be verified" in done.stdout
    unverified = json.loads((out / "rescore.json").read_text())["unverified"]
    assert [(u["prompt_idx"], u["completion"]) for u in unverified] == [(broken["prompt_idx"], 1)]
    assert "no response" in unverified[0]["reason"]
    before, after = load_run(source), load_run(out)
    kept = after.groups[0].record["completions"][1]
    assert kept["rescored"] is False and kept["reward"] == broken["completions"][1]["reward"], "listed, not dropped"
    assert [g.key for g in before.groups] == [g.key for g in after.groups]
    assert json.loads((out / "run.json").read_text())["rescore"]["source"] == str(source.resolve())
    changed = 0
    for old, new in zip(before.groups, after.groups, strict=True):
        for c_old, c_new in zip(old.record["completions"], new.record["completions"], strict=True):
            assert c_new["text"] == c_old["text"] and c_new["trace"] == c_old["trace"], "the response is unchanged"
            assert c_new["previous_reward"] == c_old["reward"]
            if not c_new["rescored"]:
                continue
            if old.agent == "lc_equivalence_rule_simple_agent":
                answer = c_old["gym_result"]["expected_answer"]
                said = " ".join(output_text(c_old["gym_result"]).strip().lower().split())
                expected = SequenceMatcher(None, said, " ".join(answer.strip().lower().split())).ratio()
                assert c_new["reward"] == pytest.approx(expected), (said, answer)
            else:
                assert c_new["reward"] == c_old["reward"], "another server's rewards do not change"
            changed += c_new["reward"] != c_old["reward"]
    assert changed >= 1, "seq_match gives partial credit to the answer exact matching scored 0"

    # compare shows what the grader change did, and says it is a rescore
    shown = cli("compare", str(source), str(out), "--out", str(tmp_path / "cmp"))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"another grader \(a rescore\): gym\\?_overrides", (tmp_path / "cmp" / "compare.md").read_text())


@pytest.mark.timeout(900)
def test_one_seed_gives_the_same_completions_alone_and_in_company(
    runs: dict[str, Path], tmp_path: Path, eval_ray_env: dict[str, str]
) -> None:
    """The tiny model samples at temperature 1; its run in the two-policy command sent four groups at a time.
    Run again alone with the same seed, one group at a time (rows meet other rows in the engine's decode
    batches differently), it gives the same tokens."""
    alone = tmp_path / "alone"
    done = cli("eval", str(ONE_POLICY), f"output_dir={alone}", f"dataset={runs['dataset']}", "embedded_policy=tiny",
               f"num_generations_per_prompt={N}", "max_new_tokens=24", "seed=0", "concurrency=1",
               "--no-progress", env=eval_ray_env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = generated_tokens(runs["tiny"]), generated_tokens(alone)
    assert sorted(first) == list(range(PROMPTS)) and first == second
    differing = sum(len({tuple(t) for t in samples}) == len(samples) for samples in first.values())
    assert differing >= PROMPTS - 1, "the samples of a group have seeds of their own and should differ"


@pytest.mark.timeout(900)
def test_a_second_command_needs_resume_which_runs_only_the_unfinished_policy(
    runs: dict[str, Path], tmp_path: Path, eval_ray_env: dict[str, str]
) -> None:
    out = tmp_path / "two"
    shutil.copytree(runs["root"], out)
    again = cli("eval", str(TWO_POLICIES), f"output_dir={out}", f"dataset={runs['dataset']}", "--no-progress")
    assert again.returncode == 2 and "not empty" in again.stderr and "--resume" in again.stderr

    tiny, scripted = out / "tiny", out / "scripted"
    tiny_results = (tiny / "results.jsonl").read_bytes()
    kept = (scripted / "results.jsonl").read_bytes().splitlines(keepends=True)[:3]
    (scripted / "results.jsonl").write_bytes(b"".join(kept))
    for name in ("compare.json", "compare.md", "compare.png"):
        (out / name).unlink()
    resumed = cli(
        "eval", str(TWO_POLICIES), f"output_dir={out}", f"dataset={runs['dataset']}", "--resume", "--no-progress",
        env=eval_ray_env,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tiny / "results.jsonl").read_bytes() == tiny_results
    assert last_session(tiny)["rollouts_started"] is None, "the finished policy started nothing"
    assert last_session(scripted)["rollouts_started"] is not None
    lines = (scripted / "results.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == PROMPTS and lines[:3] == kept
    assert json.loads((out / "compare.json").read_text())["shared_prompts"] == PROMPTS
