"""The trace viewer's file and the rescore's pieces without a browser or Gym: ``report.html`` is self-contained
(nothing fetched, every asset inline), its embedded data survives any text a model writes (``</script>``
included), ``gym-bridge report`` writes it; a rescore changes only grader settings and finds each agent's
resources server the way Gym's reverify does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from viewer_support import synthetic_run

from gym_bridge.cli import main
from gym_bridge.eval.rescore import RescoreError, agent_resources_servers, grader_config, verify_request
from gym_bridge.eval.runs import load_run
from gym_bridge.eval.viewer import VIEWER_FILE, render_viewer, viewer_data


def embedded(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S)
    assert match, "the data block"
    return json.loads(match.group(1))


def test_report_writes_a_self_contained_viewer(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", 12, 3)
    assert main(["report", str(run)]) == 0
    html = (run / VIEWER_FILE).read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "nothing is fetched"
    assert "default-src 'none'" in html, "the page forbids itself any network request"
    assert html.count("<script") == 2 and "<link" not in html
    data = embedded(html)
    assert len(data["groups"]) == 12 and all(len(g["completions"]) == 3 for g in data["groups"])
    first = data["groups"][0]["completions"][0]
    assert first["trace"][0]["role"] == "user" and first["items"][-1]["type"] == "message"
    assert "expected_answer" in first["grader"] and "response" not in first["grader"]
    assert f"]({VIEWER_FILE})" in (run / "report.md").read_text()


def test_model_text_cannot_end_the_data_block(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", 2, 1)
    data = viewer_data(run)
    evil = "</script><script>alert(1)</script><!-- \u2028"
    data["groups"][0]["completions"][0]["text"] = evil
    html = render_viewer(data)
    assert "alert(1)</script>" not in html
    assert embedded(html)["groups"][0]["completions"][0]["text"] == evil


# ---- rescore pieces --------------------------------------------------------------------------


def test_rescore_changes_only_grader_settings(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", 2, 1)
    source = load_run(run)
    config = grader_config(source, None, ["gym_overrides.lc.resources_servers.eq.grading_rule=seq_match",
                                          "pass_threshold=0.8"])  # fmt: skip
    assert config["gym_overrides"] == {"lc": {"resources_servers": {"eq": {"grading_rule": "seq_match"}}}}
    assert config["pass_threshold"] == 0.8 and source.config["gym_overrides"] == {}, "the source is not touched"
    with pytest.raises(RescoreError, match="only the grader settings"):
        grader_config(source, None, ["temperature=0.5"])


def test_agents_map_to_resources_servers_as_in_gym() -> None:
    from gym_bridge.eval.rescore import _config_blocks

    blocks = _config_blocks(["resources_servers/equivalence_rule/configs/lc.yaml"], {})
    assert agent_resources_servers(blocks) == {"lc_equivalence_rule_simple_agent": "lc_equivalence_rule"}
    row = {"responses_create_params": {"input": "q"}, "agent_ref": {"name": "a"}, "expected_answer": "x"}
    stored = {"responses_create_params": {"input": "q", "temperature": 1.0}, "response": {"output": []},
              "reward": 1.0, "expected_answer": "x", "equivalence_score": 1.0}  # fmt: skip
    body = verify_request(row, stored)
    assert body == {**row, "responses_create_params": stored["responses_create_params"], "response": {"output": []}}
    assert "reward" not in verify_request(None, stored), "without the row: the stored fields, less the verdict"
    with pytest.raises(KeyError):
        verify_request(row, {"reward": 0.0})


def test_rescore_takes_only_the_grader_settings_of_another_config(tmp_path: Path) -> None:
    import yaml

    source = load_run(synthetic_run(tmp_path / "run", 2, 1))
    other = yaml.safe_load((Path(__file__).parents[2] / "examples" / "eval_equivalence_tools.yaml").read_text())
    other.update(gym_overrides={"lc": {"x": 1}}, pass_threshold=0.5, temperature=0.3, num_generations_per_prompt=9)
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    config = grader_config(source, tmp_path / "other.yaml", [])
    assert config["gym_overrides"] == {"lc": {"x": 1}} and config["pass_threshold"] == 0.5
    assert config["config_paths"] == other["config_paths"]
    assert "temperature" not in config and "num_generations_per_prompt" not in config, "sampling is the run's"
