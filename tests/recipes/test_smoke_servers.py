"""``--smoke`` and the Gym servers a laptop cannot start: judges that start vLLM are served by the smoke model from
the run's own endpoint (or left out when nothing calls them), a config file that defines one is copied without it,
a section derived from a left-out server goes with it, and a recipe whose every agent needs containers is refused
before anything starts. Read from the installed nemo-gym's own config files; no Gym server starts here (the
served judge answering a real Gym run is in ``test_smoke_judge_gym.py``)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from gym_bridge.config.data_files import recipe_gym_configs
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.run_settings import grpo_run_keys
from gym_bridge.config.smoke import smoke_config
from gym_bridge.config.smoke_table import REMOVED
from gym_bridge.gym.servers.config_files import gym_root, read_gym_configs
from gym_bridge.recipes.pre_start import check_before_start
from gym_bridge.recipes.smoke_facts import smoke_facts
from gym_bridge.recipes.smoke_rows import remove_unstarted_copies
from gym_bridge.recipes.smoke_servers import copies_without_vllm

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "tests" / "data" / "nemo_rl_gym_gpu_recipe.yaml"
GYM = gym_root()
GENRM = "resources_servers/genrm_compare/configs/genrm_compare.yaml"
SWE = "responses_api_agents/swe_agents/configs/swebench_openhands_training.yaml"


def changed(plan) -> dict[str, tuple[object, object]]:
    return {c.key: (c.recipe, c.smoke) for c in plan.changes}


def test_a_called_judge_is_served_by_the_smoke_model_and_an_uncalled_one_left_out(tmp_path):
    """The fixture's two judges (stage1_rlvr's): math_with_judge calls one, nothing the rows use calls the other."""
    run = tmp_path / "run"
    config = load_with_overrides(RECIPE, [])
    found = smoke_facts(config, "tiny", run_dir=run)
    swaps = {s.name: s for s in found.vllm_swaps}
    assert swaps["math_judge_model"].callers == ("math_with_judge",), "the recipe's block over the file's names it"
    assert swaps["safety_judge_model"].callers == ()
    plan = smoke_config(config, found, model="tiny")
    c = changed(plan)
    judge = config["env"]["nemo_gym"]["math_judge_model"]
    assert c["env.nemo_gym.math_judge_model"] == (judge, "vllm_model: the run's endpoint")
    assert c["env.nemo_gym.safety_judge_model"][1] is REMOVED
    gym = plan.config["env"]["nemo_gym"]
    assert "math_judge_model" not in gym and "safety_judge_model" not in gym, "a recipe block is resolved early"
    served = run / "smoke-gym" / "vllm_servers.yaml"
    assert gym["config_paths"][-1] == str(served)
    assert yaml.safe_load(served.read_text()) == {"math_judge_model": {"responses_api_models": {"vllm_model": {
        "entrypoint": "app.py", "base_url": "${policy_base_url}", "api_key": "${policy_api_key}",
        "model": "${policy_model_name}", "return_token_id_information": False, "uses_reasoning_parser": False}}}}
    assert "the smoke model answers math_with_judge" in plan.table()
    budget = "env.nemo_gym.math_with_judge.resources_servers.math_with_judge.judge_responses_create_params"
    assert c[f"{budget}.max_output_tokens"] == (8192, 512), "the smoke model judges in at most 512 tokens a turn"
    check_before_start(grpo_run_keys(plan.config))  # the served file is a Gym config the early checks read
    remove_unstarted_copies(run)
    assert not run.exists(), "a smoke run refused before it starts leaves none of the copies"


def test_a_config_file_that_defines_a_vllm_server_is_copied_without_it(tmp_path):
    gym = read_gym_configs([GENRM])
    swaps = gym.vllm_swaps([GENRM], "env.nemo_gym")
    assert [(s.name, s.folder, s.callers) for s in swaps] == [
        ("genrm_model", "genrm_model", ("genrm_compare_resources_server",))]
    copies = copies_without_vllm(gym, swaps, tmp_path)
    copied = Path(copies[GENRM])
    assert copied == tmp_path / "smoke-gym" / GENRM
    original = yaml.safe_load((GYM / GENRM).read_text())
    assert yaml.safe_load(copied.read_text()) == {k: v for k, v in original.items() if k != "genrm_model"}
    again = read_gym_configs([str(copied)])
    assert {i.name for i in again.instances} == set(original) - {"genrm_model"}
    assert not any(i.starts_vllm for i in again.instances)


def test_a_server_that_scores_a_prompts_samples_together_gets_the_smokes_samples_a_prompt():
    gym = read_gym_configs([GENRM])
    cohort = "genrm_compare_resources_server.resources_servers.genrm_compare"
    assert gym.cohort_servers([GENRM], "env.nemo_gym") == [cohort]
    config = load_with_overrides(RECIPE, [])
    plan = smoke_config(config, smoke_facts(config, "tiny"), model="tiny")
    assert f"env.nemo_gym.{cohort}.num_rollouts_per_prompt" not in changed(plan), "genrm_compare is not kept here"
    facts = dataclasses.replace(smoke_facts(config, "tiny"), cohort_servers=(cohort,))
    c = changed(smoke_config(config, facts, model="tiny"))
    assert c[f"env.nemo_gym.{cohort}.num_rollouts_per_prompt"][1] == 2, "grpo.num_generations_per_prompt's smoke value"


def test_the_gym_config_readers_agree_with_gyms_merge_and_derive_directives():
    inline = {"math_with_judge": {"resources_servers": {"math_with_judge": {
        "judge_model_server": {"type": "responses_api_models", "name": "other"}}}},
        "renamed_agent": {"_inherit_from": "math_with_judge_simple_agent"}}
    gym = read_gym_configs(["resources_servers/math_with_judge/configs/math_with_judge.yaml"], inline)
    named = gym.by_name()
    assert named["math_with_judge"].refs() == {"other"}, "the recipe's block is merged over the file's"
    derived = named["renamed_agent"]
    assert (derived.server_type, derived.config_path) == ("responses_api_agents", named["math_with_judge"].config_path)
    assert derived.refs() == named["math_with_judge_simple_agent"].refs()
    assert "renamed_agent" in gym.agents()


def test_a_section_derived_from_a_left_out_server_is_left_out_with_it():
    config = load_with_overrides(RECIPE, [])
    config["env"]["nemo_gym"]["code_gen_renamed"] = {"_inherit_from": "code_gen_simple_agent"}
    plan = smoke_config(config, smoke_facts(config, "tiny"), model="tiny")
    assert changed(plan)["env.nemo_gym.code_gen_renamed"][1] is REMOVED


def test_a_recipe_whose_every_agent_needs_containers_is_refused_before_start(tmp_path):
    rows = tmp_path / "swe.jsonl"
    row = {"responses_create_params": {"input": [{"role": "user", "content": "fix the bug"}]},
           "agent_ref": {"type": "responses_api_agents", "name": "swe_agents_train"}}
    rows.write_text(json.dumps(row) + "\n")
    config = load_with_overrides(RECIPE, [f"data.train.data_path={rows}", f"data.validation.data_path={rows}"])
    config["env"]["nemo_gym"]["config_paths"] = [
        "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml", SWE]
    with pytest.raises(TrainingConfigError, match=r"container image.*swe_agents_train \(swe_agents_train\."
                                                  r"container_formatter"):
        smoke_facts(config, "tiny")
    mixed = copy.deepcopy(config)
    mixed["env"]["nemo_gym"]["config_paths"].append("resources_servers/math_with_judge/configs/math_with_judge.yaml")
    assert recipe_gym_configs(mixed).container_agents(["math_with_judge_simple_agent"]) == {}
