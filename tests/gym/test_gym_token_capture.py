"""Token capture for agents whose responses carry no token ids (Gym 0.7's ``token_id_capture``).

The agent is Gym's ``simple_agent`` with the token fields removed from its result (``tests/data/tokenless_agent``),
as an external harness returns it; the policy is our server over the tiny model, sampling at temperature 1. With
``token_id_capture`` on, Gym's model server records every call under the row's capture key and the NemoGym actor
finalises each result with Gym's own finaliser: the completions hold the endpoint's token ids, and their logprobs
equal a forward pass of the tiny model.

Every key of Gym's ``token_id_capture`` block is applied or refused in one line, and ``max_mask_fraction`` (after
``mask_fraction_min_samples``) aborts a run whose finalised captures come back masked, as Gym 0.7's collection does,
with Gym's message: in the client, in a training run's manager and in an eval run (a stand-in actor streams the
masked results; the real finaliser's builds are counted in the first test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gym_bridge.failures import RolloutRetryPolicy, RunConfigurationError, SettingError, TokenCaptureMasked
from gym_bridge.gym.protocol.result import GymRowBatch
from gym_bridge.gym.protocol.result_fields import gym_row_result
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.protocol.rows import build_rows
from gym_bridge.gym.protocol.token_capture import GYM_CAPTURE_KEYS, CaptureBuild, MaskFractionWatch, capture_block
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.gym_versions import ROLLOUT_IDENTITY_KEYS, installed_gym
from gym_bridge.testing.gym_rows import gym_actor_config, tool_call_rows
from gym_bridge.types import GenerationSamplingParams, token_tensor

pytestmark = [pytest.mark.timeout(400)]

AGENT_DIR = Path(__file__).parents[1] / "data" / "tokenless_agent"
CAPTURE = {"token_id_capture": {"enabled": True, "all_agents": True}}
CAPTURES = installed_gym().token_id_capture


@pytest.fixture(scope="module")
def capturing_actor(ray_session, tiny_sampling_policy, tiny_tokenizer, tmp_path_factory) -> Iterator[Any]:
    if not CAPTURES:
        pytest.skip(f"{installed_gym().label} has no token_id_capture (test_capture_is_refused_... covers it)")
    configs = [
        str(wheel_config_path("responses_api_models/vllm_model/configs/vllm_model_for_training.yaml")),
        str(wheel_config_path("resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml")),
        str(AGENT_DIR / "configs" / "tokenless_agent.yaml"),
    ]
    config = gym_actor_config([tiny_sampling_policy.base_url], tmp_path_factory.mktemp("capture-logs")).model_copy(
        update={
            "config_paths": configs,
            "server_dirs": {"responses_api_agents/tokenless_agent": AGENT_DIR},
            "overrides": CAPTURE,
        }
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    stop_nemo_gym_actors([actor])


@pytest.mark.gym
@pytest.mark.slow
def test_captured_tokens_and_logprobs_are_the_endpoints(capturing_actor, tiny_lm):
    _, model = tiny_lm
    rows = []
    for task, row in enumerate(tool_call_rows()[:2]):
        template = {**row, "agent_ref": {"name": "tokenless_agent"}}
        rows += build_rows(template, 2, GenerationSamplingParams(1.0, 1.0), 12, task_index=task)
    for i, row in enumerate(rows):
        row["_rowidx"] = i
    client = GymClient([capturing_actor])
    group = asyncio.run(client.run_group(rows, prompt_idx=0, deadline_s=240))
    assert len(group.rows) == 4
    assert (client.mask_watch.finalized, client.mask_watch.masked) == (4, 0), "Gym's finaliser built every result"
    for result, row in zip(group.rows, rows, strict=True):
        assert not result.mask_sample, result.full_result.get("_ng_token_capture")
        assert result.capture == CaptureBuild(False, (), None, 50)
        assert {k: result.full_result[k] for k in ROLLOUT_IDENTITY_KEYS if k in row} == {
            k: row[k] for k in ROLLOUT_IDENTITY_KEYS if k in row
        }, "the row's identity is stamped on its result"
        assistant = [m for m in result.message_log if m["role"] == "assistant"]
        assert assistant and all(m["token_ids"].numel() > 0 for m in assistant), "the capture gave token ids"
        history = torch.cat([m["token_ids"] for m in result.message_log])
        with torch.no_grad():
            logits = model(history[None, :-1]).logits[0].float()
        forward = torch.log_softmax(logits, dim=-1).gather(1, history[1:, None])[:, 0]
        end = 0
        for message in result.message_log:
            start, end = end, end + int(message["token_ids"].numel())
            if message["role"] == "assistant":
                expected = forward[start - 1 : end - 1]
                assert torch.allclose(message["generation_logprobs"], expected, atol=1e-5), (start, end)


def test_capture_is_refused_where_gym_has_none_and_for_a_sink():
    if CAPTURES:
        assert capture_block(CAPTURE) == CAPTURE["token_id_capture"]
        with pytest.raises(SettingError, match="token_id_capture.sink is not supported"):
            capture_block({"token_id_capture": {"enabled": True, "sink": "pkg:Sink"}})
        return
    with pytest.raises(SettingError, match=rf"token_id_capture needs nemo-gym >= 0.7 \({installed_gym().label}"):
        capture_block(CAPTURE)


# ---- every key of Gym's block: applied or refused in one line ------------------------------------------------------


@pytest.mark.skipif(not CAPTURES, reason=f"{installed_gym().label} has no token_id_capture")
def test_every_key_of_gyms_block_is_applied_or_refused_in_one_line():
    from nemo_gym.token_id_capture.config import TokenIdCaptureSettings

    assert set(TokenIdCaptureSettings.model_fields) == GYM_CAPTURE_KEYS, "the installed Gym's block, key for key"
    applied = {"enabled": True, "all_agents": False, "dir": "/tmp/x", "delta_records": True, "rebuild_response": True,
               "max_mask_fraction": 0.5, "mask_fraction_min_samples": 10}  # fmt: skip
    assert capture_block({"token_id_capture": applied}) == applied
    defaults = TokenIdCaptureSettings().model_dump()
    assert capture_block({"token_id_capture": {**defaults, "enabled": True}}) is not None, "Gym's defaults pass"
    refused = {
        "sink": "pkg:Sink",
        "sink_kwargs": {"a": 1},
        "lineage_store": "pkg:Store",
        "lineage_store_kwargs": {"a": 1},
        "allow_unresolved_continuations": True,
        "rebuild_response": False,
        "external_staging": True,
        "external_staging_backend": "megatron_worker",
        "control_auth_token_env": "MY_TOKEN",
    }
    for key, value in refused.items():
        with pytest.raises(SettingError, match=rf"^token_id_capture\.{key} is not supported \(set to ") as info:
            capture_block({"token_id_capture": {"enabled": True, key: value}})
        assert "\n" not in str(info.value)
    with pytest.raises(SettingError, match=r"^token_id_capture: unknown key\(s\) \['max_masked'\]; Gym's block has"):
        capture_block({"token_id_capture": {"enabled": True, "max_masked": 0.5}})
    with pytest.raises(SettingError, match="max_mask_fraction must be a number or null"):
        capture_block({"token_id_capture": {"enabled": True, "max_mask_fraction": "half"}})
    assert capture_block({"token_id_capture": {"enabled": False, "sink": "pkg:Sink"}}) is None, "off: nothing read"


# ---- max_mask_fraction: Gym's abort ------------------------------------------------------------------------------


def masked(limit: float | None = 0.5, min_samples: int = 4) -> CaptureBuild:
    return CaptureBuild(True, ("capture_incomplete",), limit, min_samples)


def test_the_mask_fraction_rule_is_gyms():
    """Counted over finalised builds (None: no build, not counted); checked once ``mask_fraction_min_samples`` builds
    are in; a masked share strictly above ``max_mask_fraction`` aborts; None disables it."""
    watch = MaskFractionWatch()
    for build in (masked(), None, CaptureBuild(False, (), 0.5, 4), masked()):
        watch.record(build)
    assert (watch.finalized, watch.masked) == (3, 2)
    watch.record(CaptureBuild(False, (), 0.5, 4))  # 2/4 = 0.5: not above the limit
    with pytest.raises(TokenCaptureMasked) as info:
        watch.record(masked())  # 3/5 = 0.6
    assert str(info.value) == (
        "3/5 finalized rollouts (60.0%) are masked, exceeding token_id_capture.max_mask_fraction=0.5. "
        "Mask reasons: {'capture_incomplete': 3}. Aborting instead of collecting mostly token-less data."
    )
    assert isinstance(info.value, RunConfigurationError), "terminal for the run, as a configuration error"
    with pytest.raises(TokenCaptureMasked):
        watch.record(None)  # the run is over
    unlimited = MaskFractionWatch()
    for _ in range(100):
        unlimited.record(masked(limit=None))
    assert unlimited.stopped is None


class _Remote:
    def __init__(self, method):
        self.method = method

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.method(*args)


class MaskingActor:
    """Stands in for the NemoGym actor without Ray: every row comes back converted, its capture build masked."""

    def __init__(self, build: CaptureBuild) -> None:
        self.build, self.sent = build, []
        self.routes = _Remote(self._routes)
        self.run_row_batches = _Remote(self._stream)

    async def _routes(self):
        return GymRoutes(agents=("agent_a",))

    async def _stream(self, rows, timer_prefix):
        self.sent.append([row["_rowidx"] for row in rows])
        for row in rows:
            user = {"role": "user", "content": "", "token_ids": token_tensor([1, 2, 3])}
            reply = {"role": "assistant", "content": "", "token_ids": token_tensor([4, 5]),
                     "generation_logprobs": torch.tensor([-0.5, -0.25])}  # fmt: skip
            result = gym_row_result(row["_rowidx"], [user, reply], {"reward": 0.0, "mask_sample": True, "response": {}})
            result.capture = self.build

            async def element(result=result):
                return GymRowBatch([result], {f"{timer_prefix}/await_results": 0.0})

            yield element()


ROW = {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "agent_a"}}
GENERATION = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}


def datum(idx: int):
    from gym_bridge.data import datum_from_gym_row

    return datum_from_gym_row(ROW, idx=idx)


def test_a_client_aborts_when_gym_would_and_every_later_group_too():
    """Two rows a group, every capture masked, the limit checked from the 4th build: the second group raises
    TokenCaptureMasked, and the third raises it before anything is sent."""
    actor = MaskingActor(masked())
    client = GymClient([actor], max_gym_row_attempts=3)
    rows = build_rows(ROW, 2, GenerationSamplingParams(1.0, 1.0), 8, task_index=0)
    group = asyncio.run(client.run_group(rows, prompt_idx=0, deadline_s=30))
    assert all(row.mask_sample for row in group.rows) and client.run_stop is None
    with pytest.raises(TokenCaptureMasked, match=r"^4/4 finalized rollouts \(100\.0%\) are masked"):
        asyncio.run(client.run_group(rows, prompt_idx=1, deadline_s=30))
    with pytest.raises(TokenCaptureMasked):
        asyncio.run(client.run_group(rows, prompt_idx=2, deadline_s=30))
    assert len(actor.sent) == 2, "nothing is sent once the run is aborted, and nothing re-sent"


def test_a_training_run_stops_on_it():
    """The training manager's policy (NeMo-RL's: 2 data attempts, no skipped prompt) ends the run with the error."""
    from gym_bridge.rollout.manager import RolloutManager
    from gym_bridge.rollout.sink import InMemorySink

    actor = MaskingActor(masked())
    policy = RolloutRetryPolicy(max_infra_attempts=5, max_data_attempts=2, max_gym_row_attempts=3)
    manager = RolloutManager(None, {"nemo_gym": actor}, 2, 100, generation_config=GENERATION, use_nemo_gym=True,
                             retry_policy=policy)  # fmt: skip
    sink = InMemorySink()
    assert asyncio.run(manager.collect(datum(0), sink)).value == "committed"
    with pytest.raises(TokenCaptureMasked, match=r"exceeding token_id_capture\.max_mask_fraction=0\.5"):
        asyncio.run(manager.collect(datum(1), sink))
    assert len(actor.sent) == 2


def test_an_eval_run_stops_on_it(tmp_path, tiny_tokenizer):
    """The eval's policy skips a failed group and goes on (unbounded skips); the run loop stops at the abort: the
    first group's result is kept, the aborted group is a failure line, nothing more is sent."""
    from types import SimpleNamespace

    from tqdm import tqdm

    from gym_bridge.eval.dataset import DatasetRow
    from gym_bridge.eval.runner import EvalOutcome, _dispatch_all, _Progress
    from gym_bridge.eval.store import RunStore, read_jsonl
    from gym_bridge.rollout.manager import RolloutManager

    actor = MaskingActor(masked())
    policy = RolloutRetryPolicy(max_infra_attempts=3, max_data_attempts=1, max_gym_row_attempts=3,
                                max_skipped_prompts=10**9)  # fmt: skip
    manager = RolloutManager(tiny_tokenizer, {"nemo_gym": actor}, 2, 100, generation_config=GENERATION,
                             use_nemo_gym=True, retry_policy=policy)  # fmt: skip
    store = RunStore(tmp_path / "run")
    store.open({"k": 1}, resume=False)
    pending = [DatasetRow(i, i + 1, ROW) for i in range(4)]
    outcome = EvalOutcome(run_dir=tmp_path / "run", prompts_total=4, done_before=0)
    state = _Progress(bar=tqdm(total=4, disable=True))
    with pytest.raises(TokenCaptureMasked, match="Aborting instead of collecting mostly token-less data"):
        asyncio.run(_dispatch_all(SimpleNamespace(concurrency=1), pending, store, manager, tiny_tokenizer, state,
                                  outcome))  # fmt: skip
    store.close()
    assert [r["prompt_idx"] for r in read_jsonl(store.results_path)] == [0]
    assert [(f["prompt_idx"], f["error"]) for f in read_jsonl(store.failures_path)] == [(1, "TokenCaptureMasked")]
    assert len(actor.sent) == 2 and (outcome.done_now, outcome.failed_now) == (1, 1)
