"""Which Gym environment this suite tests, and on which policy: the plugin's fixtures do the rest."""

import pytest

# The plugin loads by itself where gym-bridge is installed; naming it keeps the suite working with
# PYTEST_DISABLE_PLUGIN_AUTOLOAD=1.
pytest_plugins = ["gym_bridge.testing"]


@pytest.fixture(scope="session")
def gym_configs() -> list[str]:
    """Gym's policy model server plus the resources server under test (here: the wheel's equivalence_rule)."""
    return [
        "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
        "resources_servers/equivalence_rule/configs/lc.yaml",
    ]


@pytest.fixture(scope="session")
def gym_policy_name() -> str:
    """The scripted policy: deterministic replies ("Reply with exactly: X" -> "X") on the tiny tokenizer."""
    return "scripted"
