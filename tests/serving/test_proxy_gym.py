"""NeMo-Gym through the token-faithful proxy: RolloutManager(use_nemo_gym=True) -> NemoGym actor ->
real Gym servers -> the proxy -> the scripted policy served as a plain (stock-vLLM-like) upstream."""

from __future__ import annotations

import math
import re

import httpx
import pytest
import ray
import torch

from gym_bridge.data import datum_from_gym_row
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.serving import OpenAIServer, build_proxy
from gym_bridge.testing.gym_rows import SERVED_MODEL_NAME, gym_actor_config, tool_call_rows

pytestmark = [pytest.mark.gym, pytest.mark.slow]

GEN_CFG = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64, "top_k": None, "stop_strings": None}


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def proxied_gym(ray_session, tiny_tokenizer, tmp_path_factory):
    """One Gym actor (tool-call agent) whose model server talks to the proxy, not to the policy."""
    upstream = OpenAIServer(
        ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, served_model_name=SERVED_MODEL_NAME, token_id_correction=False
    )
    upstream.start_in_thread()
    proxy = build_proxy([upstream.base_url], tiny_tokenizer)
    proxy.start_in_thread()
    config = gym_actor_config([proxy.base_url], tmp_path_factory.mktemp("proxy-gym-logs"))
    config = config.model_copy(update={"config_paths": [p for p in config.config_paths if "lc.yaml" not in p]})
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor, proxy, upstream
    try:
        ray.get(actor.shutdown.remote(), timeout=60)
    finally:
        ray.kill(actor)
        proxy.stop_thread()
        proxy.state.generation.shutdown()
        upstream.stop_thread()


async def test_multi_turn_tool_episodes_through_the_proxy_do_not_drift(proxied_gym, tiny_tokenizer):
    actor, proxy, upstream = proxied_gym
    scripted = ScriptedGeneration(tiny_tokenizer)
    manager = RolloutManager(
        tokenizer=tiny_tokenizer,
        task_to_env={"nemo_gym": actor},
        num_generations_per_prompt=2,
        max_seq_len=4096,
        generation_config=GEN_CFG,
        use_nemo_gym=True,
    )
    rows = tool_call_rows()[:3]
    records = [await manager.run_rollout(datum_from_gym_row(row, idx=i)) for i, row in enumerate(rows)]
    episodes = 0
    for record in records:
        assert record.rollout_metrics["token_drift_rate"] == 0.0
        for completion in record.completions:
            episodes += 1
            log = completion.message_log
            assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]  # tool call, then answer
            for i in (1, 3):
                history = torch.cat([m["token_ids"] for m in log[:i]]).tolist()
                expected = tiny_tokenizer.encode(
                    scripted.reply_text(tiny_tokenizer.decode(history)), add_special_tokens=False
                ) + [tiny_tokenizer.eos_token_id]
                assert log[i]["token_ids"].tolist() == expected  # exactly the upstream's generation
                assert torch.allclose(log[i]["generation_logprobs"], torch.tensor(math.log(0.5)))
            assert completion.env_extras.get("token_drift") is None and not completion.truncated
            items = completion.env_extras["response"]["output"]
            assert [item["type"] for item in items][:2] == ["function_call", "function_call_output"]
    proxy_metrics = httpx.get(proxy.root_url + "/metrics").text
    upstream_metrics = httpx.get(upstream.root_url + "/metrics").text
    # every second turn reached the proxy carrying turn one's ids and was spliced
    assert metric(proxy_metrics, "gym_bridge_token_corrections_total") >= episodes
    assert metric(proxy_metrics, 'gym_bridge_requests_total{endpoint="chat_completions"}') >= 2 * episodes
    # the upstream only ever saw token-id completions, never a chat to re-tokenise
    assert metric(upstream_metrics, "gym_bridge_chat_requests_total") == 0
    assert metric(upstream_metrics, 'gym_bridge_requests_total{endpoint="completions"}') >= 2 * episodes
    print(
        f"\nGym episodes through the proxy: {episodes}, drift 0; corrections "
        f"{metric(proxy_metrics, 'gym_bridge_token_corrections_total'):.0f}, drift prevented "
        f"{metric(proxy_metrics, 'gym_bridge_token_drift_prevented_total'):.0f}"
    )
