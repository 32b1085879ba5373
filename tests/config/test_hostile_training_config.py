"""Training folders are passed around (issue 49): a config's ``${oc.env:NAME}`` values, often secrets, never land in
one. ``train()`` (what ``gym-bridge train`` runs once it has read the config and its overrides) is driven on the demo
config with a secret from the environment in two places, one of them given as a command-line override; the run itself
is replaced by a stand-in (a real run starts Gym and trains, minutes on this machine), so everything ``train()``
writes before and after it is real. The run folder's ``config.yaml`` and the loggers' hyperparameters hold the
interpolation, never the value, and ``config.yaml`` loads back to the config as trained.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gym_bridge.config.loading import load_training_config, without_env_values
from gym_bridge.config.overrides import load_with_overrides

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "grpo_nemo_gym.yaml"
SECRET_VAR = "GYM_BRIDGE_TEST_SECRET"
SECRET = "sk-test-6f1c2a9b7d3e4f50"


class StandInTrainer:
    """What ``train()`` reads of a trainer: no steps to run."""

    def __init__(self, run_dir: Path) -> None:
        self.max_steps = 0
        self.state = SimpleNamespace(step=0)
        self.metric_sinks: list[object] = []
        self.checkpoint_dir = run_dir / "checkpoint"

    async def run(self, on_step=None) -> list:
        return []


@pytest.fixture
def stand_in_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """``train()`` with Ray, the run and the plots replaced; what it gives the loggers is kept."""
    import gym_bridge.ray_utils
    import gym_bridge.recipes.grpo_run
    import gym_bridge.recipes.train

    seen: dict[str, object] = {}

    def start(settings, run_dir, *, resume=False):
        return SimpleNamespace(trainer=StandInTrainer(Path(run_dir)), close=lambda: None)

    def loggers(plan, config):
        seen["logger_config"] = config
        return SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(gym_bridge.ray_utils, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(gym_bridge.recipes.grpo_run, "start_grpo_run", start)
    monkeypatch.setattr(gym_bridge.recipes.train, "open_loggers", loggers)
    monkeypatch.setattr(gym_bridge.recipes.train, "write_training_plots", lambda run_dir: None)
    return seen


def every_byte_under(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_a_secret_from_the_environment_never_lands_in_the_run_folder(stand_in_run, tmp_path, monkeypatch):
    from gym_bridge.recipes.train import train

    monkeypatch.chdir(REPO)
    monkeypatch.setenv(SECRET_VAR, SECRET)
    config_file = tmp_path / "train.yaml"
    config_file.write_text(
        f"defaults: {DEMO}\n"
        "env:\n  nemo_gym:\n    math_with_judge:\n      resources_servers:\n        math_with_judge:\n"
        f"          judge_api_key: ${{oc.env:{SECRET_VAR}}}\n"
    )
    config = load_with_overrides(config_file, [f"logger.wandb.name=demo-${{oc.env:{SECRET_VAR}}}"])
    judge = config["env"]["nemo_gym"]["math_with_judge"]["resources_servers"]["math_with_judge"]
    assert judge["judge_api_key"] == SECRET and config["logger"]["wandb"]["name"] == f"demo-{SECRET}", "resolved"
    run = tmp_path / "run"
    train(config, run, progress=False)
    written = (run / "config.yaml").read_text()
    assert SECRET not in written and SECRET.encode() not in every_byte_under(run)
    assert f"judge_api_key: ${{oc.env:{SECRET_VAR}}}" in written
    assert f"name: demo-${{oc.env:{SECRET_VAR}}}" in written
    assert SECRET not in repr(stand_in_run["logger_config"]), "the loggers' hyperparameters hold no secret either"
    assert judge["judge_api_key"] == SECRET, "the run itself still gets the value"
    assert load_training_config(run / "config.yaml") == config, "config.yaml loads back to the config as trained"


def test_without_env_values_puts_back_whole_and_embedded_values_only(monkeypatch, tmp_path):
    monkeypatch.setenv("GYM_BRIDGE_TEST_LONG", "a-long-secret-value")
    monkeypatch.setenv("GYM_BRIDGE_TEST_SHORT", "7")
    monkeypatch.delenv("GYM_BRIDGE_TEST_UNSET", raising=False)
    file = tmp_path / "c.yaml"
    file.write_text(
        "key: ${oc.env:GYM_BRIDGE_TEST_LONG}\n"
        "header: 'Bearer ${oc.env:GYM_BRIDGE_TEST_LONG}'\n"
        "gpus: ${oc.env:GYM_BRIDGE_TEST_SHORT}\n"
        "model: Qwen2.5-7B\n"
        "steps: 7\n"
        "fallback: ${oc.env:GYM_BRIDGE_TEST_UNSET,plain-default}\n"
        "nested: {list: ['${oc.env:GYM_BRIDGE_TEST_LONG}', 3]}\n"
    )
    config = load_training_config(file)
    assert config["key"] == "a-long-secret-value" and config["gpus"] == "7"
    written = without_env_values(config)
    assert written == {
        "key": "${oc.env:GYM_BRIDGE_TEST_LONG}",
        "header": "Bearer ${oc.env:GYM_BRIDGE_TEST_LONG}",
        "gpus": "${oc.env:GYM_BRIDGE_TEST_SHORT}",
        "model": "Qwen2.5-7B",  # a short value is put back only where it is the whole string
        "steps": 7,
        "fallback": "plain-default",  # a default written in the config is no secret
        "nested": {"list": ["${oc.env:GYM_BRIDGE_TEST_LONG}", 3]},
    }
    assert config["key"] == "a-long-secret-value", "the config itself is not changed"
    assert os.environ["GYM_BRIDGE_TEST_LONG"] not in repr(written)
