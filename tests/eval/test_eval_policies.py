"""Several policies in one ``gym-bridge eval`` (``policies:``): bad configs refused in one line naming the
policy and key, and each entry an ordinary run config. The real two-policy command, its comparison and
``--resume`` per policy are tested in tests/eval/test_compare_eval.py, which shares that one run with compare,
rescore and the seed check.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gym_bridge.cli import main
from gym_bridge.eval.config import EvalConfigError, build_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "eval_two_policies.yaml"
BASE = {"dataset": "d.jsonl", "config_paths": ["c.yaml"], "output_dir": "out"}
TINY = {"name": "tiny", "embedded_policy": "tiny"}
SCRIPTED = {"name": "scripted", "embedded_policy": "scripted", "tokenizer": "tiny", "model_name": "tiny"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"policies": []}, "policies: the list is empty"),
        ({"policies": [TINY, {**SCRIPTED, "name": "tiny"}]}, "policy 'tiny' (policies.1): name: 'tiny' is already"),
        ({"policies": [TINY, {"name": "vllm", "model_name": "Q"}]}, "policy 'vllm' (policies.1): base_urls: no endpoint"),
        ({"policies": [TINY], "base_urls": ["http://h/v1"], "model_name": "Q"},
         "policies: give base_urls, model_name inside each policy entry"),
        ({"policies": [{**TINY, "modle": "x"}]}, "policy 'tiny' (policies.0): modle: unknown key"),
        ({"policies": [{"name": "e", "base_urls": ["h:8000"]}]}, "policy 'e' (policies.0): base_urls.0: 'h:8000'"),
        ({"policies": [{**TINY, "base_urls": ["http://h/v1"]}]}, "embedded_policy: give base_urls or embedded_policy"),
        ({"policies": [{**TINY, "name": "a/b"}]}, "policy 'a/b' (policies.0): name: use letters"),
    ],
)  # fmt: skip
def test_bad_policies_are_named(data: dict, message: str) -> None:
    with pytest.raises(EvalConfigError, match=re.escape(message)) as info:
        build_config({**BASE, **data})
    assert "\n" not in str(info.value)


def test_each_policy_is_an_ordinary_run_config() -> None:
    config = build_config(
        {**BASE, "num_generations_per_prompt": 3, "policies": [TINY, SCRIPTED,
         {"name": "q", "base_urls": ["http://h:8000/v1"], "model_name": "Q", "tokenizer": "/m"}]}
    )  # fmt: skip
    (n1, tiny), (n2, scripted), (n3, endpoint) = config.policy_configs()
    assert (n1, n2, n3) == ("tiny", "scripted", "q")
    assert [c.output_dir for c in (tiny, scripted, endpoint)] == [Path("out/tiny"), Path("out/scripted"), Path("out/q")]
    assert all(c.num_generations_per_prompt == 3 and c.policies is None for c in (tiny, scripted, endpoint))
    assert (tiny.embedded_policy, tiny.model_name, tiny.tokenizer) == ("tiny", "tiny", "tiny")
    assert endpoint.fingerprint("h")["policy"] == "endpoint" and endpoint.base_urls == ["http://h:8000/v1"]
    single = build_config({**BASE, "embedded_policy": "tiny"})
    assert single.policy_configs() == [] and single.model_name == "tiny", "the single-policy form is unchanged"


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASE, "policies": [TINY, {"name": "tiny", "embedded_policy": "scripted"}]}))
    assert main(["eval", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gym-bridge eval: ") and "policy 'tiny' (policies.1)" in err


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "gym_bridge.cli", "eval", str(EXAMPLE), *args, "--no-progress"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def last_session(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["sessions"][-1]
