"""A judge ``--smoke`` serves from the run's own endpoint answers inside real Gym servers: the fixture recipe's
``local_vllm_model`` math judge becomes ``smoke-gym/vllm_servers.yaml``, Gym resolves its ``${policy_base_url}``,
and math_with_judge's judge request reaches our server (the scripted policy), whose reply is the judge's verdict."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.smoke import smoke_config
from gym_bridge.gym.servers.config_files import config_path
from gym_bridge.gym.servers.owned import OwnedGym
from gym_bridge.gym.servers.server_config import GymServersConfig
from gym_bridge.recipes.smoke_facts import smoke_facts
from gym_bridge.testing import SERVED_MODEL_NAME

pytestmark = [pytest.mark.timeout(300), pytest.mark.gym]

RECIPE = Path(__file__).resolve().parents[2] / "tests" / "data" / "nemo_rl_gym_gpu_recipe.yaml"
AGENT = "math_with_judge_simple_agent"


def test_math_with_judges_judge_is_answered_by_the_run_endpoint(scripted_policy, tmp_path):
    config = load_with_overrides(RECIPE, [])
    plan = smoke_config(config, smoke_facts(config, "tiny", run_dir=tmp_path / "run"), model="tiny")
    gym = plan.config["env"]["nemo_gym"]
    overrides = {"math_with_judge": gym["math_with_judge"]}  # the recipe's block: the judge it calls, should_use_judge
    servers = OwnedGym(
        GymServersConfig(
            config_paths=[str(config_path(p)) for p in gym["config_paths"]],
            overrides=overrides,
            policy_base_urls=[scripted_policy.base_url],
            policy_model_name=SERVED_MODEL_NAME,
            log_dir=tmp_path / "gym-logs",
            startup_timeout_s=200,
            shutdown_timeout_s=15,
            use_ray=False,
        )
    )
    try:
        servers.start()
        assert "math_judge_model" in servers.server_urls and "safety_judge_model" not in servers.server_urls
        row = {
            "responses_create_params": {
                "input": [{"role": "user", "content": "What is 3 + 4? Reply with exactly: \\boxed{8}"}]
            },
            "question": "What is 3 + 4?",
            "expected_answer": "7",
        }
        answer = httpx.post(f"{servers.server_urls[AGENT]}/run", json=row, timeout=120).json()
    finally:
        servers.stop()
    evaluations = answer.get("judge_evaluations")
    assert answer["library_reward"] == 0.0 and evaluations, f"a wrong boxed answer goes to the judge: {answer}"
    verdict = evaluations[0]["response"]["output"][-1]["content"][0]["text"]
    assert verdict == scripted_policy.state.generation.default_reply, "the judge is the scripted policy on our server"
    assert answer["reward"] == 0.0
