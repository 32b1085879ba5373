"""How a child config and command-line overrides change a parent's sections: NeMo-RL's rules, one test each.

NeMo-RL (``nemo_rl/utils/config.py`` at 7ea279a) merges a child over its ``defaults:`` parents with
``OmegaConf.merge`` (``_override_: true`` on a top-level section replaces the parent's section) and applies
command-line overrides with Hydra's ``OmegaConf.update(..., merge=True)``. So a mapping set to ``{}`` keeps the parent's
keys (a warning here says so and how to remove them), ``null`` replaces them, ``~key`` deletes the key, and an
``_override_`` below the top level is not read (a warning). ``checkpointing.enabled: false`` writes no checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import yaml

from gym_bridge.config.grpo import checkpointing_enabled, loop_config_from
from gym_bridge.config.loading import load_training_config
from gym_bridge.config.overrides import load_with_overrides

PARENT = {
    "grpo": {"num_prompts_per_step": 2, "max_num_steps": 1},
    "data": {
        "train": {"data_path": "train.jsonl"},
        "validation": {"data_path": "val.jsonl", "extra_sets": {"heldout_other": "other.jsonl"}},
    },
    "checkpointing": {"enabled": True, "save_period": 5},
}


def write(folder: Path, name: str, content: dict) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(content, sort_keys=False))
    return path


def child(tmp_path: Path, content: dict) -> Path:
    write(tmp_path, "parent.yaml", PARENT)
    return write(tmp_path, "child.yaml", {"defaults": "parent.yaml", **content})


def extra_sets(config: dict) -> object:
    return config["data"]["validation"].get("extra_sets", "(no key)")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_child_mapping_set_to_empty_keeps_the_parents_keys_as_in_nemo_rl_and_says_so(tmp_path, caplog):
    config = load_training_config(child(tmp_path, {"data": {"validation": {"extra_sets": {}}}}))
    assert extra_sets(config) == {"heldout_other": "other.jsonl"}, "OmegaConf.merge of {} changes nothing"
    [warning] = warnings_of(caplog)
    assert "child.yaml sets data.validation.extra_sets to {}, which keeps the parent's 1 key(s) (heldout_other)" in (
        warning
    )
    assert "'extra_sets: null' there (or ~data.validation.extra_sets on the command line) removes them" in warning


def test_a_child_mapping_set_to_null_drops_the_parents_keys(tmp_path, caplog):
    config = load_training_config(child(tmp_path, {"data": {"validation": {"extra_sets": None}}}))
    assert extra_sets(config) is None
    assert warnings_of(caplog) == []


def test_a_top_level_override_marker_replaces_the_parents_section(tmp_path):
    config = load_training_config(child(tmp_path, {"data": {"_override_": True, "train": {"data_path": "mine.jsonl"}}}))
    assert config["data"] == {"train": {"data_path": "mine.jsonl"}}


def test_an_override_marker_below_the_top_level_merges_as_in_nemo_rl_and_says_so(tmp_path, caplog):
    config = load_training_config(
        child(tmp_path, {"data": {"validation": {"extra_sets": {"_override_": True, "mine": "m.jsonl"}}}})
    )
    assert extra_sets(config) == {"heldout_other": "other.jsonl", "_override_": True, "mine": "m.jsonl"}
    [warning] = warnings_of(caplog)
    assert "data.validation.extra_sets._override_ is below the top level, where NeMo-RL does not read it" in warning


def test_tilde_on_the_command_line_deletes_the_key(tmp_path):
    config = load_with_overrides(write(tmp_path, "parent.yaml", PARENT), ["~data.validation.extra_sets"])
    assert extra_sets(config) == "(no key)"


def test_empty_on_the_command_line_merges_as_hydra_does_and_names_the_tilde(tmp_path, caplog):
    config = load_with_overrides(write(tmp_path, "parent.yaml", PARENT), ["data.validation.extra_sets={}"])
    assert extra_sets(config) == {"heldout_other": "other.jsonl"}, "Hydra's OmegaConf.update(merge=True)"
    [warning] = warnings_of(caplog)
    assert warning.startswith("the command line sets data.validation.extra_sets to {}")
    assert "~data.validation.extra_sets removes them" in warning


def test_null_on_the_command_line_drops_the_parents_keys(tmp_path):
    config = load_with_overrides(write(tmp_path, "parent.yaml", PARENT), ["data.validation.extra_sets=null"])
    assert extra_sets(config) is None


def test_the_validation_sets_follow_the_merged_config(tmp_path):
    from gym_bridge.config.run_data import run_data, validation_sets

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"responses_create_params": {"input": "1+1?"}, "agent_ref": {"name": "a"}}\n')
    sets = {"data_path": str(rows), "extra_sets": {"other": str(rows)}}
    parent = {**PARENT, "data": {"train": {"data_path": str(rows)}, "validation": sets}}
    write(tmp_path, "parent.yaml", parent)
    dropped = load_training_config(
        write(tmp_path, "child.yaml", {"defaults": "parent.yaml", "data": {"validation": {"extra_sets": None}}})
    )
    assert [s.name for s in validation_sets(run_data(dropped), None)] == ["validation"]
    kept = load_training_config(
        write(tmp_path, "child2.yaml", {"defaults": "parent.yaml", "data": {"validation": {"extra_sets": {}}}})
    )
    assert [s.name for s in validation_sets(run_data(kept), None)] == ["validation", "other"]


def test_checkpointing_disabled_in_a_child_config_writes_no_checkpoint(tmp_path, tiny_model_dir):
    from test_training_loop import SPREAD, FixedGroups, NullEngine, dataset

    from gym_bridge.config.training import nemo_gym_rollout_settings
    from gym_bridge.policy import HFPolicy, HFPolicyConfig
    from gym_bridge.training import GRPOTrainer

    base = {
        **PARENT,
        "policy": {"model_name": "tiny", "max_total_sequence_length": 256, "generation": {"max_new_tokens": 8}},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 2, "seed": 5},
        "env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": ["a.yaml"]}},
    }
    write(tmp_path, "parent.yaml", base)
    config = load_training_config(
        write(tmp_path, "child.yaml", {"defaults": "parent.yaml", "checkpointing": {"enabled": False}})
    )
    assert checkpointing_enabled(config) is False
    assert checkpointing_enabled(load_training_config(tmp_path / "parent.yaml")) is True
    loop = loop_config_from(config, nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:1/v1"]))
    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3, keep_reference_model=False))
    out = tmp_path / "run"
    trainer = GRPOTrainer(loop, manager=FixedGroups(), policy=policy, engine=NullEngine(), dataset=dataset(SPREAD),
                          out_dir=out, save_checkpoints=checkpointing_enabled(config))  # fmt: skip
    history = asyncio.run(trainer.run())
    assert [m["step"] for m in history if m["kind"] == "train"] == [0, 1]
    assert not (out / "checkpoint").exists() and not (out / "checkpoint.partial").exists()
    enabled = GRPOTrainer(loop, manager=FixedGroups(), policy=policy, engine=NullEngine(), dataset=dataset(SPREAD),
                          out_dir=tmp_path / "enabled")  # fmt: skip
    asyncio.run(enabled.run())
    assert (tmp_path / "enabled" / "checkpoint" / "trainer_state.json").exists(), "the default still saves at the end"
