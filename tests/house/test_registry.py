"""The backend registry: built-ins, a third-party distribution, unknown and broken names."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from gym_bridge.rollout.backend import BackendOptionsError
from gym_bridge.rollout.manager import RolloutManager, backend_name_for
from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl
from gym_bridge.rollout.registry import (
    BackendLoadError,
    BackendNotFoundError,
    available_backends,
    load_backend,
)
from gym_bridge.types import DatumSpec, token_tensor

THIRD_PARTY_MODULE = '''
from gym_bridge.rollout.backend import BackendOptions
from gym_bridge.types import Completion, PromptGroupRecord


class EchoOptions(BackendOptions):
    custom_option: str = "default"


class EchoBackend:
    """Returns the prompt as every completion, with reward = generation index."""

    Options = EchoOptions

    def __init__(self, num_generations_per_prompt, max_seq_len, options):
        self.n = num_generations_per_prompt
        self.max_seq_len = max_seq_len
        self.options = options

    @classmethod
    def from_context(cls, context, options):
        return cls(context.num_generations_per_prompt, context.max_seq_len, options)

    async def run_rollout(self, datum):
        completions = [Completion(list(datum["message_log"]), None, False, float(i)) for i in range(self.n)]
        return PromptGroupRecord(datum["idx"], datum["message_log"], None, {"task_name": "echo"}, completions, {})


class StrictOptions(BackendOptions):
    flavour: str = "plain"
    rounds: int = 1


class StrictBackend(EchoBackend):
    Options = StrictOptions


class ShortBackend(EchoBackend):
    async def run_rollout(self, datum):
        record = await super().run_rollout(datum)
        record.completions.pop()
        return record


class NoOptionsBackend:
    """The contract before typed options: a constructor of keywords, no Options model."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    async def run_rollout(self, datum):
        raise NotImplementedError


class SyncBackend(EchoBackend):
    def run_rollout(self, datum):
        raise NotImplementedError
'''


def install_distribution(site: Path, name: str, entry_points: dict[str, str], module: str | None = None) -> None:
    """Install a minimal distribution into ``site`` the way an installer lays it out (dist-info + code)."""
    dist_info = site / f"{name.replace('-', '_')}-1.2.3.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[gym_bridge.rollout_backends]\n{lines}\n")
    if module is not None:
        (site / f"{name.replace('-', '_')}.py").write_text(textwrap.dedent(module))


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    install_distribution(
        tmp_path,
        "acme-rollouts",
        {
            "echo": "acme_rollouts:EchoBackend",
            "short": "acme_rollouts:ShortBackend",
            "strict": "acme_rollouts:StrictBackend",
            "untyped": "acme_rollouts:NoOptionsBackend",
            "sync": "acme_rollouts:SyncBackend",
            "broken": "acme_rollouts_missing.module:Backend",
            "not_a_backend": "acme_rollouts:THIRD_PARTY_CONSTANT",
        },
        THIRD_PARTY_MODULE + "\nTHIRD_PARTY_CONSTANT = 1\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("acme_rollouts", None)


def _datum() -> DatumSpec:
    log = [{"role": "user", "content": "hi", "token_ids": token_tensor([1, 2, 3])}]
    return DatumSpec(message_log=log, length=3, extra_env_info=None, loss_multiplier=1.0, idx=7)


def test_builtin_backends_are_registered_by_this_package():
    found = available_backends()
    assert {"native", "nemo_gym"} <= set(found)
    assert found["native"].value == "gym_bridge.rollout.native:AsyncRolloutImpl"
    assert found["native"].distribution.startswith("gym-bridge ")
    from gym_bridge.rollout.native import AsyncRolloutImpl

    assert load_backend("native") is AsyncRolloutImpl


def test_backend_name_resolution():
    assert backend_name_for(False, None) == "native"
    assert backend_name_for(True, None) == "nemo_gym"
    assert backend_name_for(False, "echo") == "echo"
    assert backend_name_for(True, "nemo_gym") == "nemo_gym"
    with pytest.raises(ValueError, match="conflicts"):
        backend_name_for(True, "native")


def test_use_nemo_gym_selects_the_nemo_gym_backend():
    assert load_backend("nemo_gym") is AsyncNemoGymRolloutImpl
    with pytest.raises(ValueError, match="needs a NemoGym actor"):
        RolloutManager(None, {}, 2, 128, use_nemo_gym=True, generation_config={})


def test_unknown_backend_lists_the_registered_names():
    with pytest.raises(BackendNotFoundError) as info:
        RolloutManager(None, {}, 2, 128, backend="does_not_exist")
    message = str(info.value)
    assert "'does_not_exist'" in message and "native" in message and "nemo_gym" in message


async def test_third_party_backend_is_found_and_used(third_party):
    assert available_backends()["echo"].distribution == "acme-rollouts 1.2.3"
    manager = RolloutManager(None, {}, 3, 128, backend="echo", custom_option="passed through")
    assert manager.backend.options.custom_option == "passed through"
    assert manager.backend.max_seq_len == 128 and manager.context.num_generations_per_prompt == 3
    record = await manager.run_rollout(_datum())
    assert record.prompt_idx == 7
    assert [c.reward for c in record.completions] == [0.0, 1.0, 2.0]


async def test_a_misspelt_or_mistyped_option_is_one_line_naming_it_before_anything_is_built(third_party):
    manager = RolloutManager(None, {}, 2, 128, backend="strict", flavour="spicy")
    assert manager.backend.options.flavour == "spicy" and manager.backend.options.rounds == 1
    assert len((await manager.run_rollout(_datum())).completions) == 2
    with pytest.raises(BackendOptionsError) as info:
        RolloutManager(None, {}, 2, 128, backend="strict", flavor="red")
    message = str(info.value)
    assert "\n" not in message
    assert message == "rollout backend 'strict': unknown option 'flavor' (it takes: flavour, rounds)"
    with pytest.raises(BackendOptionsError, match=r"option 'rounds': Input should be a valid integer"):
        RolloutManager(None, {}, 2, 128, backend="strict", rounds="many")


def test_the_built_in_backends_refuse_a_misspelt_option_at_load(tiny_tokenizer):
    with pytest.raises(BackendOptionsError) as info:
        RolloutManager(tiny_tokenizer, {}, 2, 128, use_nemo_gym=True, generation_config={}, max_gym_row_atempts=3)
    assert str(info.value).startswith("rollout backend 'nemo_gym': unknown option 'max_gym_row_atempts' (it takes:")
    with pytest.raises(BackendOptionsError, match="rollout backend 'nemo_gym': option 'seed'"):
        RolloutManager(tiny_tokenizer, {}, 2, 128, use_nemo_gym=True, generation_config={}, seed="7")
    with pytest.raises(BackendOptionsError, match="rollout backend 'native': unknown option 'temperature'"):
        RolloutManager(tiny_tokenizer, {}, 2, 128, temperature=0.5)


def test_a_class_outside_the_contract_is_refused_when_loaded(third_party):
    with pytest.raises(BackendLoadError, match="'untyped' registered by acme-rollouts 1.2.3 .* declares no Options"):
        load_backend("untyped")
    with pytest.raises(BackendLoadError, match="'sync' .* has no async run_rollout"):
        load_backend("sync")


async def test_a_backend_that_loses_a_completion_is_caught(third_party):
    manager = RolloutManager(None, {}, 3, 128, backend="short")
    with pytest.raises(RuntimeError, match="returned 2 completions for prompt_idx=7; expected 3"):
        await manager.run_rollout(_datum())


def test_broken_entry_point_names_its_distribution(third_party):
    with pytest.raises(BackendLoadError) as info:
        load_backend("broken")
    assert "acme-rollouts 1.2.3" in str(info.value)
    assert "ModuleNotFoundError" in str(info.value)
    with pytest.raises(BackendLoadError, match="acme-rollouts 1.2.3.*not a class"):
        load_backend("not_a_backend")


def test_duplicate_registration_is_refused(third_party, tmp_path_factory, monkeypatch):
    other = tmp_path_factory.mktemp("other-site")
    install_distribution(other, "other-rollouts", {"echo": "other_rollouts:Echo"})
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(BackendLoadError, match="registered more than once.*acme-rollouts.*other-rollouts|"
                       "registered more than once.*other-rollouts.*acme-rollouts"):
        load_backend("echo")


def test_invalid_manager_arguments():
    with pytest.raises(ValueError, match="num_generations_per_prompt"):
        RolloutManager(None, {}, 0, 128)
    with pytest.raises(ValueError, match="policy_generation"):
        RolloutManager(None, {}, 2, 128)
