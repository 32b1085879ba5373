"""A real training run over two Gym environments logs each one's metrics: ``train/<agent>/<field>/...`` for
math_with_judge's agent and example_tool_call_multireward's, each over its own samples, its reward components as
``train/<agent>/reward/<name>/...`` (Gym's ``reward_components``), in ``metrics.jsonl`` and read back with
TensorBoard's own reader (``EventAccumulator``), and ``validation/<agent>/...`` for a validation over both. One
prompt is sent to both environments, and stays two groups, one per environment (Gym #589: advantage groups must
never merge environments that share a prompt). The model's chat template branches on ``enable_thinking``, which
``policy.tokenizer.chat_template_kwargs`` sets: every prompt Gym's model calls rendered (the ids the trainer
scores) opens the thinking block.

One GRPO step of the tiny model, in process, through the Gym servers the run starts itself (both environments'
configs in ``env.nemo_gym.config_paths``, math_with_judge graded by math-verify only): two prompts per environment,
two generations each, eight new tokens a sample; then a validation at the end over one row of each environment.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from thinking_model import thinking_model

from gym_bridge.gym.servers.config_files import wheel_config_path

REPO = Path(__file__).resolve().parents[2]
MATH_AGENT = "math_with_judge_simple_agent"
TOOL_AGENT = "example_tool_call_multireward_simple_agent"
COMPONENTS = ("correctness", "format", "schema_valid")
AGENTS = (MATH_AGENT, TOOL_AGENT)
PROMPTS_PER_AGENT = 2
GENERATIONS = 2
GYM_CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/math_with_judge/configs/math_with_judge.yaml",
    "resources_servers/example_tool_call_multireward/configs/example_tool_call_multireward.yaml",
]
# examples/grpo_nemo_gym.yaml's math_with_judge: math-verify only (no judge model is called)
MATH_OVERRIDES = {
    "math_with_judge": {
        "resources_servers": {
            "math_with_judge": {
                "should_use_judge": False,
                "library_verifier_max_concurrency": 2,
                "library_verifier_timeout_seconds": 60,
                "judge_model_server": {"type": "responses_api_models", "name": "policy_model"},
            }
        }
    },
    "math_with_judge_simple_agent": {"responses_api_agents": {"simple_agent": {"datasets": []}}},
}
# the fields the per-agent rule (gym_bridge/training/agent_metrics.py) logs for each agent: every numeric field of the
# agent's Gym results (reward at least) as calculate_single_metric's statistics, and the agent's masked rate
STATISTICS = ("mean", "max", "min", "median", "stddev")

pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def math_rows() -> list[dict[str, Any]]:
    """The train-demo's arithmetic rows (short prompts), routed to math_with_judge's agent."""
    lines = (REPO / "examples" / "data" / "arith_train.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[: PROMPTS_PER_AGENT + 1]]
    assert all(row["agent_ref"]["name"] == MATH_AGENT for row in rows)
    return rows


def tool_call_rows() -> list[dict[str, Any]]:
    """The wheel's example rows for example_tool_call_multireward (one get_weather call, three reward components),
    routed to its agent; the first asks math_rows()'s first question instead (the prompt both environments get)."""
    path = wheel_config_path("resources_servers/example_tool_call_multireward/data/example.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["agent_ref"] = {"type": "responses_api_agents", "name": TOOL_AGENT}
    rows[0]["responses_create_params"]["input"] = math_rows()[0]["responses_create_params"]["input"]
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def trained(ray_session, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One step over both environments (their rows interleaved), validated at the end; TensorBoard on."""
    from gym_bridge.recipes.train import train

    folder = tmp_path_factory.mktemp("two-environments")
    model = thinking_model(tiny_model_dir, folder / "thinking-model")
    maths, tools = math_rows(), tool_call_rows()
    pairs = zip(maths[:PROMPTS_PER_AGENT], tools[:PROMPTS_PER_AGENT], strict=True)
    train_rows = [row for pair in pairs for row in pair]  # the environments interleaved
    config: dict[str, Any] = {
        "use_nemo_gym": True,
        "grpo": {
            "num_prompts_per_step": 2 * PROMPTS_PER_AGENT,
            "num_generations_per_prompt": GENERATIONS,
            "max_num_steps": 1,
            "seed": 0,
            "val_at_end": True,
            "val_num_generations_per_prompt": 1,
        },
        "policy": {
            "model_name": str(model),
            "tokenizer": {"chat_template_kwargs": {"enable_thinking": True}},
            "max_total_sequence_length": 2048,
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0},
        },
        "checkpointing": {"enabled": False},
        "env": {
            "nemo_gym": {
                "config_paths": GYM_CONFIGS,
                **MATH_OVERRIDES,
                "rollout_timeout_s": 240,
                "startup_timeout_s": 240,
                "actor_options": {"num_cpus": 0},
            }
        },
        "data": {
            "shuffle": False,
            "train": {"data_path": str(write_rows(folder / "train.jsonl", train_rows))},
            "validation": {"data_path": str(write_rows(folder / "val.jsonl", [maths[-1], tools[-1]]))},
        },
        "logger": {"tensorboard_enabled": True},
    }
    run = folder / "run"
    started = time.perf_counter()
    train(config, run, progress=False)
    print(f"gym-bridge train over two environments, one step and a validation: {time.perf_counter() - started:.0f} s")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"run": run, "lines": lines}


def the_line(trained: dict[str, Any], kind: str) -> dict[str, Any]:
    (line,) = [m for m in trained["lines"] if m["kind"] == kind]
    return line


def agents_of(line: dict[str, Any], prefix: str) -> set[str]:
    """The agents whose ``<prefix><agent>/reward/mean`` the line holds."""
    return {
        key.removeprefix(prefix).split("/")[0]
        for key in line
        if key.startswith(prefix) and key.endswith("/reward/mean") and key.count("/") == prefix.count("/") + 2
    }


def per_agent_keys(line: dict[str, Any], prefix: str, agent: str) -> dict[str, float]:
    return {key: value for key, value in line.items() if key.startswith(f"{prefix}{agent}/")}


def test_each_environment_has_its_own_metrics_in_the_step_line(trained: dict[str, Any]) -> None:
    line = the_line(trained, "train")
    assert line["step"] == 0 and line["train/groups"] == 2 * PROMPTS_PER_AGENT, line
    assert line["train/samples"] == 2 * PROMPTS_PER_AGENT * GENERATIONS, line
    assert agents_of(line, "train/") == set(AGENTS), "one set of keys per environment, neither merged nor missing"
    mine = {agent: per_agent_keys(line, "train/", agent) for agent in AGENTS}
    for agent, keys in mine.items():
        for statistic in STATISTICS:
            assert isinstance(keys[f"train/{agent}/reward/{statistic}"], float), (agent, statistic, keys)
        assert keys[f"train/{agent}/masked_rate"] == 0.0, keys
        assert all(math.isfinite(v) for v in keys.values()), keys
    relative = [{key.removeprefix(f"train/{agent}/") for key in keys} for agent, keys in mine.items()]
    assert relative[0] & relative[1] >= {f"reward/{s}" for s in STATISTICS} | {"masked_rate"}
    assert not set(mine[MATH_AGENT]) & set(mine[TOOL_AGENT]), "the two agents' keys differ"
    # each agent's own Gym result fields: math-verify's library_reward is math_with_judge's alone
    assert f"train/{MATH_AGENT}/library_reward/mean" in line and f"train/{TOOL_AGENT}/library_reward/mean" not in line
    # the reward components are the multi-reward environment's alone
    for component in COMPONENTS:
        assert isinstance(line[f"train/{TOOL_AGENT}/reward/{component}/mean"], float), line
        assert f"train/{MATH_AGENT}/reward/{component}/mean" not in line


def test_every_prompt_rendered_with_the_recipes_template_arguments(trained: dict[str, Any]) -> None:
    """Each model call's prompt (``prompt_str``: the decoded ids the trainer scores) ends in the thinking block the
    template opens only with ``enable_thinking``."""
    results = [json.loads(x) for x in (trained["run"] / "nemo_gym_full_results.jsonl").read_text().splitlines()]
    prompts = [item["prompt_str"] for r in results for item in r["full_result"]["response"]["output"]
               if "prompt_str" in item]  # fmt: skip
    assert len(prompts) >= len(results) and all(p.endswith("<|im_start|>assistant\n<think>\n") for p in prompts), [
        p[-60:] for p in prompts
    ]


def test_a_prompt_both_environments_get_stays_two_groups(trained: dict[str, Any]) -> None:
    """The shared prompt's samples are two groups (two prompt indices), each all from one environment, and each
    environment's components or fields are its own; no group mixes agents."""
    results = [json.loads(x) for x in (trained["run"] / "nemo_gym_full_results.jsonl").read_text().splitlines()]
    by_group: dict[int, list[dict[str, Any]]] = {}
    for result in results:
        by_group.setdefault(result["prompt_idx"], []).append(result)
    assert len(by_group) == 2 * PROMPTS_PER_AGENT and all(len(g) == GENERATIONS for g in by_group.values())
    assert all(len({r["agent"] for r in group}) == 1 for group in by_group.values()), "a group mixes environments"

    def conversation(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(m["role"], m["content"]) for m in messages]  # Gym's echo adds its own message fields

    shared = conversation(math_rows()[0]["responses_create_params"]["input"])
    asked = {
        idx: group[0]["agent"]
        for idx, group in by_group.items()
        if conversation(group[0]["full_result"]["responses_create_params"]["input"]) == shared
    }
    assert sorted(asked.values()) == sorted(AGENTS), asked
    for group in by_group.values():
        components = [("reward_components" in r["full_result"]) for r in group]
        assert components == [group[0]["agent"] == TOOL_AGENT] * GENERATIONS, group[0]["agent"]


def test_the_per_agent_samples_add_up_to_the_steps_samples(trained: dict[str, Any]) -> None:
    """The run's Gym results (``nemo_gym_full_results.jsonl``: one line per training sample, with its agent) count
    each agent's samples: two prompts times two generations each, together the step's samples; each agent's logged
    statistics are those of its own results' fields, and the two weighted means give the step's mean reward."""
    line = the_line(trained, "train")
    results = [json.loads(x) for x in (trained["run"] / "nemo_gym_full_results.jsonl").read_text().splitlines()]
    by_agent: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_agent.setdefault(result["agent"], []).append(result["full_result"])
    counts = {agent: len(mine) for agent, mine in by_agent.items()}
    assert counts == {agent: PROMPTS_PER_AGENT * GENERATIONS for agent in AGENTS}, counts
    assert sum(counts.values()) == line["train/samples"], line
    for agent, mine in by_agent.items():
        for field in ("reward", *(["library_reward"] if agent == MATH_AGENT else [])):
            values = [float(r[field]) for r in mine]
            assert line[f"train/{agent}/{field}/mean"] == pytest.approx(sum(values) / len(values)), (agent, field)
            low, high = line[f"train/{agent}/{field}/min"], line[f"train/{agent}/{field}/max"]
            assert (low, high) == (min(values), max(values)), (agent, field)
    pooled = sum(line[f"train/{agent}/reward/mean"] * n for agent, n in counts.items()) / line["train/samples"]
    assert pooled == pytest.approx(line["train/mean_reward"], abs=1e-9), line


def test_the_validation_reports_each_environment(trained: dict[str, Any]) -> None:
    val = the_line(trained, "val")
    assert val["step"] == 1, val
    assert agents_of(val, "val/") == set(AGENTS), "the validation's keys, one set per environment"
    for agent in AGENTS:
        assert isinstance(val[f"val/{agent}/reward/mean"], float) and val[f"val/{agent}/masked_rate"] == 0.0, val


def test_tensorboard_holds_the_same_per_agent_values_at_the_step(trained: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    line, val = the_line(trained, "train"), the_line(trained, "val")
    expected = {
        (key, 1): value
        for agent in AGENTS
        for key, value in per_agent_keys(line, "train/", agent).items()  # a step logs at the steps done: 1
    }
    expected.update({
        ("validation/" + key.removeprefix("val/"), 1): value
        for agent in AGENTS
        for key, value in per_agent_keys(val, "val/", agent).items()
    })  # fmt: skip
    assert len({key.split("/")[1] for key, _ in expected}) == len(AGENTS)
    events = EventAccumulator(str(trained["run"] / "logs" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for agent in AGENTS:
        assert f"train/{agent}/reward/mean" in tags and f"validation/{agent}/reward/mean" in tags, sorted(tags)
    for component in COMPONENTS:
        assert f"train/{TOOL_AGENT}/reward/{component}/mean" in tags, sorted(tags)
        assert f"validation/{TOOL_AGENT}/reward/{component}/mean" in tags, sorted(tags)
    for (name, step), value in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(name) if e.step == step] == [
            (step, pytest.approx(value, rel=1e-6, abs=1e-9))
        ], name
    logged = {tag for tag in tags if tag.startswith("train/") and tag.split("/")[1] in AGENTS}
    assert logged == {key for key, _ in expected if key.startswith("train/")}, "every per-agent key, and no more"
