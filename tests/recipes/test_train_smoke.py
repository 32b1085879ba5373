"""``gym-bridge train RECIPE --smoke`` and the checks that run before Ray starts.

The rewrite (:func:`gym_bridge.config.smoke.smoke_config`) is a pure function, tested here on a trimmed copy of
NeMo-RL's Gym recipes (``tests/data/nemo_rl_gym_gpu_recipe.yaml``: Megatron, bfloat16, colocation, vLLM's GPU keys,
``max_new_tokens: ${policy.max_total_sequence_length}``, 64 x 16 samples a step, four Gym configs) with facts given
by hand; :func:`gym_bridge.recipes.smoke_facts.smoke_facts` reads the real facts (the installed nemo-gym's configs
and example rows, the tiny model's tokenizer). The early checks name the key to change and run before Ray: the
command refuses a batch larger than the dataset in seconds, with no Ray started. The last test runs the smoke
recipe end to end through real Gym servers. None of this needs a NeMo-RL checkout (``make smoke-recipes`` runs the
real recipes).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from gym_bridge.config.data_files import recipe_gym_configs as gym_configs
from gym_bridge.config.grpo import row_routing
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.overrides import load_with_overrides, override_keys
from gym_bridge.config.run_settings import grpo_run_keys, grpo_run_settings
from gym_bridge.config.gpu_keys import gpu_only_keys
from gym_bridge.config.smoke import SMOKE_MAX_NEW_TOKENS, SmokeFacts, smoke_config
from gym_bridge.config.smoke_table import REMOVED
from gym_bridge.config.training import context_length
from gym_bridge.gym.servers.config_files import gym_root
from gym_bridge.recipes.pre_start import RowFile, check_agents, check_batch, check_before_start, check_context
from gym_bridge.recipes.prompt_length import model_facts
from gym_bridge.recipes.smoke_facts import smoke_facts
from gym_bridge.testing.cli import run_cli
from gym_bridge.training.loop_config import GRPOLoopConfig

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "tests" / "data" / "nemo_rl_gym_gpu_recipe.yaml"
GYM = gym_root()
MATH_ROWS = GYM / "resources_servers" / "math_with_judge" / "data" / "example.jsonl"
WORKPLACE_ROWS = GYM / "resources_servers" / "workplace_assistant" / "data" / "example.jsonl"
MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
MATH_CONFIG = "resources_servers/math_with_judge/configs/math_with_judge.yaml"


def recipe(*overrides: str) -> dict:
    return load_with_overrides(RECIPE, list(overrides))


def facts(**given) -> SmokeFacts:
    base = {"train_path": str(MATH_ROWS), "train_rows": 5, "longest_prompt": 250, "model_context": 8192}
    return SmokeFacts(**{**base, **given})


def changed(plan) -> dict[str, tuple[object, object]]:
    return {c.key: (c.recipe, c.smoke) for c in plan.changes}


def test_the_smoke_rewrite_scales_the_recipe_and_turns_every_gpu_feature_off():
    plan = smoke_config(recipe(), facts(validation_paths={"data.validation.data_path": None}))
    c = changed(plan)
    assert c["policy.model_name"] == ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", "smollm2")
    assert c["grpo.num_prompts_per_step"] == (64, 2)
    assert c["grpo.num_generations_per_prompt"] == (16, 2)
    assert c["policy.train_global_batch_size"] == (1024, 4), "one step's samples, as the loop requires"
    assert c["grpo.max_num_steps"] == (1000000, 1)
    assert c["policy.max_total_sequence_length"] == (49152, 8192), "the model's own context"
    for engine_key in ("policy.generation.vllm_cfg.max_model_len",):
        assert c[engine_key] == (49152, 8192), "the engine's copy stays equal to the context"
    assert c["policy.generation.max_new_tokens"] == (49152, SMOKE_MAX_NEW_TOKENS)
    assert c["data.validation.data_path"] == ("/path/to/validation.jsonl", str(MATH_ROWS))
    assert c["grpo.max_val_samples"] == (None, 2)
    assert c["grpo.val_num_generations_per_prompt"] == (4, 1)
    assert c["checkpointing.enabled"] == (True, False)
    assert c["logger.log_dir"] == ("logs/grpo-nanov3", REMOVED)
    assert "loss_fn.use_on_policy_kl_approximation" not in c, "NeMo-RL's on-policy KL weight is implemented"
    for key, off in [
        ("policy.megatron_cfg.enabled", False),
        ("policy.precision", "float32"),
        ("policy.generation.vllm_cfg.precision", "float32"),
        ("policy.generation.colocated.enabled", False),
        ("policy.generation.vllm_cfg.tensor_parallel_size", 1),
        ("policy.sequence_packing.enabled", False),
        ("cluster.gpus_per_node", 0),
        ("cluster.num_nodes", 1),
        ("logger.monitor_gpus", False),
    ]:
        assert c[key][1] == off, key
    ignored = {i.key: i.value for i in plan.ignored}
    assert ignored["policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser"] == "nemotron_json"
    assert ignored["policy.generation.vllm_kwargs.compilation_config"] == {"backend": "eager"}
    assert ignored["policy.generation.vllm_cfg.gpu_memory_utilization"] == 0.5
    assert "policy.precision" not in ignored, "a key turned off is a change, not an ignored key"
    table = plan.table()
    assert "nemotron_json" in table and "(ignored)" in table and "bfloat16" in table and "float32" in table
    assert table.count("\n") == len(plan.changes) + len(plan.ignored) + 2, "one table: title, header, rule, rows"


def test_the_rewritten_recipe_is_read_by_the_trainer_without_a_refusal():
    given = facts(validation_paths={"data.validation.data_path": None}, route_to="math_with_judge_simple_agent")
    plan = smoke_config(recipe(), given)
    settings = grpo_run_settings(plan.config)
    assert (settings.loop.num_prompts_per_step, settings.rollout.launch.num_generations_per_prompt) == (2, 2)
    assert settings.max_model_len == 8192 and settings.engine.max_new_tokens == SMOKE_MAX_NEW_TOKENS
    assert settings.loop.max_num_steps == 1
    assert len(settings.train_rows) == 5 and [len(s.rows) for s in settings.validation_sets] == [2]


def test_the_recipe_itself_is_refused_by_name_without_the_rewrite():
    with pytest.raises(TrainingConfigError, match="policy.megatron_cfg.enabled"):
        grpo_run_settings(recipe(f"data.train.data_path={MATH_ROWS}", "policy.model_name=tiny"))


def test_a_key_the_command_line_set_is_kept_and_named():
    plan = smoke_config(
        recipe("grpo.num_generations_per_prompt=3"), facts(), pinned=["grpo.num_generations_per_prompt"]
    )
    assert "grpo.num_generations_per_prompt" not in changed(plan)
    assert plan.config["grpo"]["num_generations_per_prompt"] == 3
    assert plan.config["policy"]["train_global_batch_size"] == 6, "the batch follows the kept value"
    assert "kept as the command line set them: grpo.num_generations_per_prompt" in plan.table()
    assert override_keys(["+a.b=1", "~c", "++d=2", "e.f=3"]) == ["a.b", "c", "d", "e.f"]


def test_lengths_fit_the_dataset_and_the_models_context():
    one_row = smoke_config(recipe(), facts(train_rows=1))
    assert one_row.config["grpo"]["num_prompts_per_step"] == 1
    long_prompt = smoke_config(recipe(), facts(longest_prompt=8150))
    assert long_prompt.config["policy"]["generation"]["max_new_tokens"] == 42, "the room the longest prompt leaves"
    roomy = smoke_config(recipe("policy.max_total_sequence_length=1024"), facts())
    assert "policy.max_total_sequence_length" not in changed(roomy), "a context under the model's is kept"
    assert roomy.config["policy"]["generation"]["max_new_tokens"] == SMOKE_MAX_NEW_TOKENS


def test_a_cpu_run_without_smoke_lists_the_gpu_only_keys_it_ignores():
    listed = {i.key: i.value for i in gpu_only_keys(recipe())}
    assert listed["policy.precision"] == "bfloat16"
    assert listed["policy.generation.colocated.enabled"] is True
    assert listed["cluster.gpus_per_node"] == 8
    assert listed["logger.monitor_gpus"] is True
    assert listed["policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser"] == "nemotron_json"
    assert "policy.megatron_cfg.enabled" not in listed, "refused by the trainer, not ignored"
    quiet = recipe(
        "policy.precision=float32",
        "policy.generation.colocated.enabled=false",
        "cluster.gpus_per_node=0",
        "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser=hermes",
    )
    assert not {"policy.precision", "policy.generation.colocated.enabled", "cluster.gpus_per_node"} & {
        i.key for i in gpu_only_keys(quiet)
    }


def test_smoke_facts_read_gyms_example_rows_route_them_and_leave_unused_environments_out():
    found = smoke_facts(recipe(), "tiny")
    assert found.train_path == str(MATH_ROWS) and found.example_agent == "math_with_judge_simple_agent"
    assert found.train_rows == 5
    assert found.validation_paths == {"data.validation.data_path": None}
    assert found.route_to == "math_with_judge_simple_agent", "the agent that declares the rows' file"
    assert found.config_paths == (MODEL_CONFIG, MATH_CONFIG)
    assert found.unused_instances == ("code_gen",), "the recipe's section for a server that is not started"
    assert found.model_context == 2048 and found.longest_prompt is not None and found.longest_prompt > 20
    plan = smoke_config(recipe(), found, model="tiny")
    c = changed(plan)
    assert c["env.nemo_gym.agent_name"][1] == "math_with_judge_simple_agent"
    assert c["env.nemo_gym.code_gen"][1] is REMOVED
    assert plan.config["env"]["nemo_gym"]["config_paths"] == [MODEL_CONFIG, MATH_CONFIG]
    check_before_start(grpo_run_keys(plan.config))  # the rewritten recipe passes every early check


def test_a_training_file_named_on_the_command_line_is_not_replaced():
    found = smoke_facts(recipe("data.train.data_path=/nowhere.jsonl"), "tiny", pinned=["data.train.data_path"])
    assert found.train_path is None and found.example_agent is None


def test_rows_past_the_smoke_context_are_left_out_of_a_copy_in_the_run_folder_and_counted(tmp_path):
    """The tiny model's context is 2,048 tokens: two rows of ~3,000 words do not fit; a copy of the file without them
    goes in the run folder, the smoke table counts them, and the rewritten recipe passes every early check."""
    data = tmp_path / "rows.jsonl"
    agent = {"type": "responses_api_agents", "name": "math_with_judge_simple_agent"}
    source = [{**json.loads(line), "agent_ref": agent} for line in MATH_ROWS.read_text().splitlines()]
    long = {**source[0], "responses_create_params": {"input": [{"role": "user", "content": "count " * 3000}]}}
    lines = [json.dumps(r) for r in (source[0], long, source[1], long, source[2])]
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    config = recipe(f"data.train.data_path={data}", f"data.validation.data_path={data}")
    found = smoke_facts(config, "tiny", run_dir=run)
    copy = run / "smoke-data" / "data.train.data_path.jsonl"
    assert found.fitted["data.train.data_path"] == (str(copy), 2, 5, 2048)
    assert copy.read_text().splitlines() == [lines[0], lines[2], lines[4]], "the rows that fit, as they were written"
    assert found.train_rows == 5 and found.longest_prompt is not None and found.longest_prompt < 2048
    plan = smoke_config(config, found, model="tiny")
    assert changed(plan)["data.train.data_path"] == (str(data), str(copy))
    assert "2 of 5 rows render past the 2048-token context" in plan.table()
    check_before_start(grpo_run_keys(plan.config))
    assert smoke_facts(config, "tiny").fitted == {}, "without a run folder nothing is copied"


# ------------------------------------------------------------------------------------------- checks before Ray starts


def rows(path: Path, key: str = "data.train.data_path") -> RowFile:
    from gym_bridge.recipes.pre_start import read_rows

    found = read_rows(key, path)
    assert found is not None
    return found


def test_a_batch_larger_than_the_dataset_names_the_key_and_both_numbers():
    [problem] = check_batch(GRPOLoopConfig(num_prompts_per_step=64, max_num_epochs=1), rows(WORKPLACE_ROWS))
    assert problem.startswith("grpo.num_prompts_per_step=64 needs at least 64 prompts; data.train.data_path (")
    assert f"{WORKPLACE_ROWS}) has 5" in problem
    assert check_batch(GRPOLoopConfig(num_prompts_per_step=5, max_num_epochs=1), rows(WORKPLACE_ROWS)) == []
    assert check_batch(GRPOLoopConfig(num_prompts_per_step=64), rows(WORKPLACE_ROWS)) == [], "no epoch bound"


def test_a_long_prompt_plus_max_new_tokens_over_the_context_is_a_warning_naming_both_numbers_and_both_keys():
    """NeMo-RL's recipes set max_new_tokens to the whole context; its training server (and ours) cuts a request's
    max_tokens to the room its prompt leaves, so the run goes on, and the warning says how much room that is."""
    model = model_facts("smollm2")
    assert model is not None and model.context == 8192
    context = context_length(recipe("policy.max_total_sequence_length=8192"))  # max_new_tokens follows it: 8192
    problems, [warning] = check_context(context, 8192, [rows(WORKPLACE_ROWS)], model)
    assert problems == []
    longest = int(warning.split("renders to ")[1].split(" ")[0])
    assert longest > 4000, "26 tools in the prompt"
    assert f"policy.generation.max_new_tokens=8192 leaves it {8192 - longest} tokens to generate" in warning
    assert "within policy.max_total_sequence_length=8192" in warning
    assert f"set policy.generation.max_new_tokens={8192 - longest} or policy.max_total_sequence_length=" in warning
    assert check_context(8192, 64, [rows(WORKPLACE_ROWS)], model) == ([], [])
    _, warnings = check_context(context_length(recipe()), 64, [rows(WORKPLACE_ROWS)], model)
    assert warnings and "policy.max_total_sequence_length=49152 is over smollm2's own context (8192" in warnings[0]


def test_the_longest_prompt_is_found_among_many_rows_by_rendering_the_longest_few(tmp_path):
    from gym_bridge.recipes.prompt_length import longest_prompt

    model = model_facts("tiny")
    assert model is not None
    many = tmp_path / "many.jsonl"
    short = {"responses_create_params": {"input": [{"role": "user", "content": "2+2?"}]}}
    long = {"responses_create_params": {"input": [{"role": "user", "content": "count " * 300}]}}
    many.write_text("\n".join(json.dumps(long if i == 37 else short) for i in range(50)) + "\n")
    found = longest_prompt([rows(many)], model.tokenizer, rendered=4)
    assert found is not None and found.where.endswith("row 37") and found.tokens > 300


def test_agents_are_checked_against_the_gym_configs(tmp_path):
    config = recipe()
    gym = gym_configs(config)
    assert "workplace_assistant_simple_agent" in gym.agents() and gym.complete
    [unrouted] = check_agents(row_routing(config), [rows(WORKPLACE_ROWS)], gym)
    assert "5 of 5 rows name no agent" in unrouted
    assert "set +env.nemo_gym.agent_name=workplace_assistant_simple_agent" in unrouted
    named = tmp_path / "named.jsonl"
    row = json.loads(MATH_ROWS.read_text().splitlines()[0])
    named.write_text(json.dumps({**row, "agent_ref": {"name": "nobody_agent"}}) + "\n")
    [unknown] = check_agents(row_routing(config), [rows(named)], gym)
    assert "names agent(s) nobody_agent that no config in env.nemo_gym.config_paths defines" in unknown
    wrong = recipe("+env.nemo_gym.agent_name=typo_agent")
    assert any(
        "env.nemo_gym.agent_name=typo_agent" in p for p in check_agents(row_routing(wrong), [], gym_configs(wrong))
    )
    missing = recipe("env.nemo_gym.config_paths=[resources_servers/not_shipped/configs/x.yaml]")
    [problem] = check_agents(row_routing(missing), [], gym_configs(missing))
    assert "resources_servers/not_shipped/configs/x.yaml is neither a file" in problem and "nemo-gym 0." in problem


def test_train_refuses_a_batch_larger_than_the_dataset_before_ray_starts(tmp_path, monkeypatch):
    import gym_bridge.ray_utils
    from gym_bridge.recipes import train as train_module

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the early checks refused the run")

    monkeypatch.setattr(gym_bridge.ray_utils, "init_ray", no_ray)
    given = facts(validation_paths={"data.validation.data_path": None}, route_to="math_with_judge_simple_agent")
    config = smoke_config(recipe(), given).config  # a config the trainer reads, with 64 prompts a step for 5 rows
    config["grpo"]["num_prompts_per_step"] = 64
    config["policy"]["train_global_batch_size"] = 64 * config["grpo"]["num_generations_per_prompt"]
    with pytest.raises(TrainingConfigError, match=r"grpo\.num_prompts_per_step=64 needs at least 64 prompts"):
        train_module.train(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists(), "nothing written"


def test_the_command_refuses_it_in_seconds_with_no_ray_session(tmp_path):
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    started = time.monotonic()
    done = run_cli("train", str(RECIPE), "--smoke", "--model", "tiny", f"data.train.data_path={WORKPLACE_ROWS}",
                   "grpo.num_prompts_per_step=64", "--out", str(tmp_path / "run"), env=env, timeout=180)  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert "gym-bridge train: grpo.num_prompts_per_step=64 needs at least 64 prompts; data.train.data_path" in (
        done.stderr
    )
    assert elapsed < 90, f"refused after {elapsed:.0f}s"  # imports only (typically ~10 s; 2 busy cores)
    assert not (tmp_path / "ray").exists() and not (tmp_path / "run").exists(), "no Ray session, no run folder"


def test_a_run_without_smoke_lists_the_gpu_only_keys_in_one_table():
    from gym_bridge.recipes.train import gpu_keys_table

    table = gpu_keys_table(recipe())
    assert table is not None and "GPU-only key(s) of this config change nothing in a CPU run" in table
    assert "policy.generation.colocated.enabled" in table and "nemotron_json" in table


def test_model_needs_smoke(tmp_path):
    done = run_cli("train", str(RECIPE), "--model", "tiny", "--out", str(tmp_path / "run"), timeout=120)
    assert done.returncode == 2 and "--model goes with --smoke" in done.stderr


@pytest.mark.gym
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_recipe_runs_one_step_with_smoke_and_no_other_override(tmp_path):
    """The recipe-shaped fixture through the real command: Gym's math_with_judge example rows, the tiny model."""
    run = tmp_path / "run"
    done = run_cli("train", str(RECIPE), "--smoke", "--model", "tiny", "--out", str(run), "--no-progress",
                   cwd=tmp_path, timeout=1100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--smoke:" in done.stdout and "policy.megatron_cfg.enabled" in done.stdout
    assert "nemotron_json" in done.stdout and "(ignored)" in done.stdout
    assert "checkpoint: none (checkpointing.enabled: false)" in done.stdout
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["kind"] for m in lines] == ["val", "train"], "validation at start (the recipe's), one step"
    assert not (run / "checkpoint").exists(), "checkpointing.enabled: false"
    written = yaml.safe_load((run / "config.yaml").read_text())
    served = run / "smoke-gym" / "vllm_servers.yaml"
    assert written["env"]["nemo_gym"]["config_paths"] == [MODEL_CONFIG, MATH_CONFIG, str(served)]
    logs = {p.stem for p in (run / "gym-logs").glob("*.log")}
    assert "math_judge_model" in logs and "safety_judge_model" not in logs, "the called judge served, the other out"
    assert not (tmp_path / "logs").exists(), "the logs stay in the run folder"


def test_the_early_checks_take_max_new_tokens_as_the_typed_settings_carry_it():
    """Set: the engine's value; not set: None (the engine's default is no budget the config asked for)."""
    from gym_bridge.recipes.pre_start import max_new_tokens

    config = smoke_config(recipe(), facts(validation_paths={"data.validation.data_path": None},
                                          route_to="math_with_judge_simple_agent")).config  # fmt: skip
    assert max_new_tokens(grpo_run_keys(config)) == SMOKE_MAX_NEW_TOKENS
    del config["policy"]["generation"]["max_new_tokens"]
    assert max_new_tokens(grpo_run_keys(config)) is None


def test_a_model_name_its_launcher_fills_is_replaced_like_any_other():
    for overrides in (("policy.model_name=null",), ("~policy.model_name",)):
        plan = smoke_config(recipe(*overrides), facts(validation_paths={"data.validation.data_path": None}))
        assert plan.config["policy"]["model_name"] == "smollm2", overrides
        assert changed(plan)["policy.model_name"][1] == "smollm2"


def test_unset_launcher_variables_get_scratch_folders_in_the_run_folder(tmp_path, monkeypatch):
    from gym_bridge.recipes.smoke_env import load_with_scratch_env

    name = "GYM_BRIDGE_TEST_UNSET_CACHE"
    monkeypatch.delenv(name, raising=False)
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {RECIPE}\nenv:\n  nemo_gym:\n    uv_venv_dir: ${{oc.env:{name}}}/gym_venvs\n")
    with pytest.raises(TrainingConfigError, match=name):
        load_with_overrides(child, [])
    run = tmp_path / "run"
    config, changes = load_with_scratch_env(child, [], run)
    scratch = run / "smoke-env" / name
    assert config["env"]["nemo_gym"]["uv_venv_dir"] == f"{scratch}/gym_venvs" and scratch.is_dir()
    assert [(c.key, c.smoke) for c in changes] == [(f"${{oc.env:{name}}}", str(scratch))]
    monkeypatch.setenv(name, "/set/by/launcher")  # a variable that is set keeps its value
    kept, none = load_with_scratch_env(child, [], tmp_path / "other")
    assert kept["env"]["nemo_gym"]["uv_venv_dir"] == "/set/by/launcher/gym_venvs" and none == []
    plan = smoke_config(config, facts(), model="tiny")
    assert changed(plan)["env.nemo_gym.uv_venv_dir"] == (f"{scratch}/gym_venvs", REMOVED)


def test_a_negative_val_period_is_no_periodic_validation_as_in_nemo_rl():
    config = recipe("grpo.val_period=-1")
    assert grpo_run_keys(smoke_config(config, facts(), model="tiny").config).loop.val_period == 0


def test_a_refused_smoke_run_removes_only_what_it_made(tmp_path):
    from gym_bridge.recipes.smoke_rows import remove_unstarted_copies

    made = tmp_path / "made"
    (made / "smoke-data").mkdir(parents=True)
    (made / "smoke-env" / "X").mkdir(parents=True)
    remove_unstarted_copies(made)
    assert not made.exists(), "the copies and the folder they were made in are gone"
    empty = tmp_path / "empty"
    empty.mkdir()
    remove_unstarted_copies(empty)
    assert empty.is_dir(), "an empty --out made beforehand stays"
    kept = tmp_path / "kept"
    (kept / "smoke-data").mkdir(parents=True)
    (kept / "notes.txt").write_text("mine")
    remove_unstarted_copies(kept)
    assert (kept / "notes.txt").exists() and not (kept / "smoke-data").exists()
