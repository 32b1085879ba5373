"""API keys both ways, on real servers: our server and proxy require a ``Bearer`` key on ``/v1/*`` as vLLM's
``--api-key`` does; preflight, the proxy's upstream calls, gym-bridge's Gym model server, ``check-endpoint``,
``serve`` and an eval through real Gym send one; the key never reaches a file of the run or its output.
Also vLLM's 400s for a ``max_tokens`` beyond the context and an unknown role, and the actor config winning
over Gym's ``policy_*`` keys (as NeMo-RL's actor does)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from gym_bridge.eval.config import EvalConfigError, build_config
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.preflight import EndpointProblem, PreflightError, check_endpoint, preflight_endpoints
from gym_bridge.serving import OpenAIServer, ServerFeatures, build_proxy
from gym_bridge.serving.auth import inbound_api_key, is_loopback, open_port_warning
from gym_bridge.serving.upstream import UpstreamError
from gym_bridge.testing import wait_until
from gym_bridge.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-9c4e1f7a2b5d8e3f"  # planted: must never be written anywhere
PROXY_KEY = "sk-proxy-41b7d2c9e8a3"
ENV_WITHOUT_KEYS = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "VLLM_API_KEY")}


def _start(tokenizer: Any, *, api_key: str | None = None, host: str = "127.0.0.1", **kwargs: Any) -> OpenAIServer:
    from gym_bridge.generation.scripted import ScriptedGeneration

    server = OpenAIServer(
        ScriptedGeneration(tokenizer, max_new_tokens=8),
        tokenizer,
        served_model_name="tiny",
        host=host,
        api_key=api_key,
        **kwargs,
    )
    server.start_in_thread()
    return server


@pytest.fixture(scope="module")
def keyed(tiny_tokenizer) -> Iterator[OpenAIServer]:
    """Our server over the scripted policy, started with ``api_key=KEY``."""
    server = _start(tiny_tokenizer, api_key=KEY, max_model_len=2048)
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def open_server(tiny_tokenizer) -> Iterator[OpenAIServer]:
    """The same server without a key."""
    server = _start(tiny_tokenizer, max_model_len=512)
    yield server
    server.stop_thread()


def _chat(base_url: str, key: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "Reply with exactly: hi"}], **body}
    return httpx.post(f"{base_url}/chat/completions", json=payload, headers=headers, timeout=30)


# ---------------------------------------------------------------- inbound: serve --api-key


def test_v1_routes_need_the_key_and_the_rest_stay_open_as_in_vllm(keyed):
    url, root = keyed.base_url, keyed.root_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        refused = httpx.get(f"{url}/models", headers=headers, timeout=10)
        assert refused.status_code == 401, headers
        assert refused.json() == {"error": "Unauthorized"}
    assert _chat(url).status_code == 401
    assert httpx.post(f"{url}/completions", json={"prompt": "hi"}, timeout=10).status_code == 401

    assert httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    assert httpx.get(f"{url}/models", headers={"Authorization": f"bearer {KEY}"}, timeout=10).status_code == 200
    served = _chat(url, KEY)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"] == "hi"
    # vLLM's middleware guards only paths under /v1: health, metrics and the tokenizer routes stay open
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200
    assert httpx.get(f"{root}/metrics", timeout=10).status_code == 200
    assert httpx.post(f"{root}/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 200


def test_the_inbound_key_comes_from_the_flag_else_vllm_api_key():
    assert inbound_api_key("a", {"VLLM_API_KEY": "b"}).get_secret_value() == "a"
    assert inbound_api_key(None, {"VLLM_API_KEY": "b"}).get_secret_value() == "b"
    assert inbound_api_key(None, {}) is None
    assert inbound_api_key("", {"VLLM_API_KEY": ""}) is None


def test_listening_beyond_loopback_without_a_key_says_so_in_one_line(tiny_tokenizer, caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gpu-node-3")
    assert open_port_warning("127.0.0.1", 8000, None) is None
    assert open_port_warning("0.0.0.0", 8000, SecretStr("k")) is None
    line = open_port_warning("0.0.0.0", 8000, None)
    assert line is not None and "\n" not in line and "0.0.0.0:8000" in line and "--api-key" in line

    caplog.set_level(logging.WARNING, logger="gym_bridge.serving.server")
    for key in (KEY, None):
        server = _start(tiny_tokenizer, api_key=key, host="0.0.0.0")
        server.stop_thread()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "API key" in r.getMessage()]
    assert len(warnings) == 1, warnings  # only the server without a key
    assert "without an API key" in warnings[0] and KEY not in caplog.text


# ---------------------------------------------------------------- vLLM's 400s instead of a clamp


def test_max_tokens_beyond_the_context_is_vllms_400(keyed, tiny_tokenizer):
    too_many = _chat(keyed.base_url, KEY, max_tokens=100_000_000)
    assert too_many.status_code == 400
    error = too_many.json()["error"]
    assert error["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 100000000.")
    assert "maximum context length is 2048 tokens" in error["message"] and error["param"] == "max_tokens"
    completion = httpx.post(
        f"{keyed.base_url}/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2100},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert completion.status_code == 400 and "is too large: 2100" in completion.json()["error"]["message"]
    assert _chat(keyed.base_url, KEY, max_tokens=2000).status_code == 200  # within the room: served

    clamping = _start(tiny_tokenizer, max_model_len=512, features=ServerFeatures(clamp_max_tokens=True))
    try:
        clamped = _chat(clamping.base_url, max_tokens=100_000_000)
        assert clamped.status_code == 200, clamped.text  # NeMo-RL's training server cuts it to the room
    finally:
        clamping.stop_thread()


def test_an_unknown_role_is_a_400_naming_it(keyed):
    for route in ("chat/completions", "../tokenize"):
        answer = httpx.post(
            f"{keyed.base_url}/{route}",
            json={"model": "tiny", "messages": [{"role": "user", "content": "a"}, {"role": "alien", "content": "b"}]},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert answer.status_code == 400, route
        assert "message 1 has role 'alien'" in answer.json()["error"]["message"]


# ---------------------------------------------------------------- outbound: preflight, proxy, Gym model server


def test_preflight_names_a_missing_or_wrong_key_and_a_key_to_an_open_endpoint_is_fine(keyed, open_server):
    url = keyed.base_url
    missing = check_endpoint(url, "tiny", timeout_s=10)
    assert missing.problem is EndpointProblem.KEY_REFUSED
    assert missing.line == f"{url} refused the API key (401): no key was sent"
    wrong = check_endpoint(url, "tiny", timeout_s=10, api_key="wrong")
    assert wrong.line == f"{url} refused the API key (401)"
    assert check_endpoint(url, "tiny", timeout_s=10, api_key=SecretStr(KEY)).ok
    assert check_endpoint(open_server.base_url, "tiny", timeout_s=10, api_key=KEY).ok
    with pytest.raises(PreflightError) as raised:
        preflight_endpoints([url], "tiny", timeout_s=10, api_key="wrong")
    assert str(raised.value) == f"endpoint {url} refused the API key (401)"
    assert KEY not in str(raised.value)


def test_the_proxy_forwards_its_upstream_key_and_requires_its_own(keyed, tiny_tokenizer):
    proxy = build_proxy([keyed.base_url], api_key=SecretStr(KEY), inbound_api_key=PROXY_KEY)  # discovery sends it
    proxy.start_in_thread()
    try:
        assert _chat(proxy.base_url).status_code == 401
        assert _chat(proxy.base_url, KEY).status_code == 401  # the upstream's key is not the proxy's
        served = _chat(proxy.base_url, PROXY_KEY)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"] == "hi"
    finally:
        proxy.stop_thread()
        proxy.state.generation.shutdown()

    keyless = build_proxy([keyed.base_url], tiny_tokenizer, upstream_model="tiny", max_model_len=2048)
    keyless.start_in_thread()
    try:
        refused = _chat(keyless.base_url)
        assert refused.status_code == 401, refused.text  # the upstream's 401 is handed on
    finally:
        keyless.stop_thread()
        keyless.state.generation.shutdown()
    with pytest.raises(UpstreamError, match=r"refused the API key \(401\)$"):
        build_proxy([keyed.base_url], api_key="wrong")


async def test_gym_bridge_model_server_sends_the_key(keyed, tiny_tokenizer):
    from gym_bridge.gym_model.app import GymModelServer
    from gym_bridge.gym_model.config import GymModelConfig

    body = {"input": [{"role": "user", "content": "Reply with exactly: hi"}], "max_output_tokens": 8}
    config = GymModelConfig(port=0, base_url=[keyed.base_url], model="tiny", api_key=SecretStr(KEY))
    assert KEY not in repr(config) and KEY not in config.model_dump_json()
    server = GymModelServer(config, tiny_tokenizer)
    await server.start()
    try:
        answer = await server.responses(body, "s1")
    finally:
        await server.client.close()
    assert answer["output"][-1]["content"][0]["text"] == "hi"

    wrong = GymModelServer(config.model_copy(update={"api_key": SecretStr("wrong")}), tiny_tokenizer)
    await wrong.start()
    try:
        with pytest.raises(Exception, match="HTTP 401") as raised:
            await wrong.responses(body, "s1")
        assert getattr(raised.value, "status", None) == 401
    finally:
        await wrong.client.close()


# ---------------------------------------------------------------- configs: where the key comes from


def test_nemo_gym_config_reads_the_key_from_the_environment_never_from_text(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "from-openai-var")
    monkeypatch.setenv("MY_ENDPOINT_KEY", "from-my-var")
    base = {"model_name": "tiny", "base_urls": ["http://127.0.0.1:9/v1"]}
    assert NemoGymConfig(**base).api_key.get_secret_value() == "from-openai-var"
    assert NemoGymConfig(**base, api_key_env_var="MY_ENDPOINT_KEY").api_key.get_secret_value() == "from-my-var"
    assert NemoGymConfig(**base, api_key=SecretStr("given")).api_key.get_secret_value() == "given"
    with pytest.raises(ValidationError, match="api_key is not taken as text"):
        NemoGymConfig(**base, api_key="sk-literal")
    with pytest.raises(ValidationError, match="NO_SUCH_KEY_VAR is not set"):
        NemoGymConfig(**base, api_key_env_var="NO_SUCH_KEY_VAR")
    monkeypatch.delenv("OPENAI_API_KEY")
    assert NemoGymConfig(**base).api_key.get_secret_value() == "dummy_key"  # NeMo-RL's value: no key needed


def test_the_actor_config_wins_over_gyms_policy_keys_as_in_nemo_rl(caplog):
    """NeMo-RL's NemoGym actor sets policy_base_url, policy_model_name and policy_api_key of Gym's global config
    from its own config whatever the YAML says (nemo_rl/environments/nemo_gym.py); ours does the same."""
    caplog.set_level(logging.WARNING, logger="gym_bridge.gym.servers.server_config")
    config = NemoGymConfig(
        model_name="tiny",
        base_urls=["http://127.0.0.1:9/v1"],
        api_key=SecretStr(KEY),
        initial_global_config_dict={
            "policy_base_url": "http://elsewhere:8000/v1",
            "policy_model_name": "other-model",
            "policy_api_key": "yaml-key",
            "default_host": "127.0.0.1",
        },
    )
    servers = config.servers_config()
    assert not {"policy_base_url", "policy_model_name", "policy_api_key"} & set(servers.overrides)
    assert servers.overrides["default_host"] == "127.0.0.1"
    assert servers.policy_base_urls == ["http://127.0.0.1:9/v1"] and servers.policy_model_name == "tiny"
    assert servers.policy_api_key.get_secret_value() == KEY
    [warning] = [r.getMessage() for r in caplog.records]
    assert "policy_api_key, policy_base_url, policy_model_name ignored" in warning
    assert "yaml-key" not in caplog.text and KEY not in caplog.text

    same = NemoGymConfig(
        model_name="tiny", base_urls=["http://127.0.0.1:9/v1"], overrides={"policy_base_url": "http://127.0.0.1:9/v1"}
    )
    caplog.clear()
    assert "policy_base_url" not in same.servers_config().overrides
    assert not caplog.records  # the same value: nothing to say


def test_the_eval_config_names_a_variable_never_holds_a_key(monkeypatch, tmp_path):
    base = {"dataset": "d.jsonl", "config_paths": ["c.yaml"], "output_dir": str(tmp_path)}
    with pytest.raises(EvalConfigError, match="an API key is never written in the config"):
        build_config({**base, "api_key": "sk-literal"})
    with pytest.raises(EvalConfigError, match="api_key_env_var: the environment variable NO_SUCH_KEY_VAR is not set"):
        build_config({**base, "base_urls": ["http://127.0.0.1:9/v1"]}, ["api_key_env_var=NO_SUCH_KEY_VAR"])
    monkeypatch.setenv("NAMED_KEY_VAR", KEY)
    config = build_config({**base, "base_urls": ["http://127.0.0.1:9/v1"], "api_key_env_var": "NAMED_KEY_VAR"})
    assert config.api_key().get_secret_value() == KEY
    assert KEY not in json.dumps(config.model_dump(mode="json")) and KEY not in json.dumps(config.fingerprint("x"))


# ---------------------------------------------------------------- the commands


def _cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=REPO, env=env, timeout=timeout)


@pytest.mark.e2e
def test_check_endpoint_sends_the_key_from_the_flag_or_openai_api_key(keyed):
    url = keyed.base_url
    missing = _cli("check-endpoint", url, "--model", "tiny", env=ENV_WITHOUT_KEYS)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [f"{url} refused the API key (401): no key was sent"]
    assert _cli("check-endpoint", url, "--model", "tiny", "--api-key", KEY, env=ENV_WITHOUT_KEYS).returncode == 0
    from_env = _cli("check-endpoint", url, "--model", "tiny", env={**ENV_WITHOUT_KEYS, "OPENAI_API_KEY": KEY})
    assert from_env.returncode == 0, from_env.stderr
    assert KEY not in from_env.stdout + from_env.stderr


@pytest.mark.e2e
def test_serve_with_a_key_from_vllm_api_key(tmp_path):
    port = free_port("127.0.0.1")
    log = tmp_path / "serve.log"
    env = {**ENV_WITHOUT_KEYS, "VLLM_API_KEY": KEY}
    args = [sys.executable, "-m", "gym_bridge.cli", "serve", "--policy", "instant", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        root = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{root}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 180, "gym-bridge serve answering /health", poll_s=0.2)
        assert _chat(f"{root}/v1").status_code == 401
        assert _chat(f"{root}/v1", "wrong").status_code == 401
        assert _chat(f"{root}/v1", KEY).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    assert KEY not in log.read_text()
    assert "without an API key" not in log.read_text()


# ---------------------------------------------------------------- an eval through real Gym


def _eval(run: Path, url: str, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    return _cli(
        "eval",
        "examples/eval_equivalence_tools.yaml",
        f"output_dir={run}",
        f"base_urls=[{url}]",
        "limit=2",
        "num_generations_per_prompt=2",
        *overrides,
        "--no-progress",
        env={**env, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"},
        timeout=600,
    )


@pytest.mark.gym
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_eval_against_a_keyed_endpoint_runs_and_writes_the_key_nowhere(keyed, tmp_path, eval_ray_env):
    """Through real Gym (its vllm_model sends Gym's policy_api_key): the key named by api_key_env_var passes
    preflight and every turn, although the YAML's gym_overrides carry another policy_api_key (the actor config
    wins); no file of the run folder and no line of the output holds the key. The command joins the evals'
    shared Ray (``eval_ray_env``) instead of starting its own."""
    url = keyed.base_url
    run = tmp_path / "run"
    without_keys = {k: v for k, v in eval_ray_env.items() if k not in ("OPENAI_API_KEY", "VLLM_API_KEY")}
    env = {**without_keys, "EVAL_ENDPOINT_KEY": KEY}
    done = _eval(run, url, env, "api_key_env_var=EVAL_ENDPOINT_KEY", "gym_overrides.policy_api_key=yaml-key")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 of 2 prompt groups done (0 failed this run)" in done.stdout
    files = [path for path in run.rglob("*") if path.is_file()]
    assert any(path.name == "run.json" for path in files) and any(path.suffix == ".log" for path in files)
    holding = [str(path) for path in files if KEY.encode() in path.read_bytes()]
    assert not holding, f"the API key is written in {holding}"
    assert KEY not in done.stdout + done.stderr


@pytest.mark.e2e
def test_an_eval_without_the_key_stops_in_preflight_with_one_line(keyed, tmp_path):
    url = keyed.base_url
    refused = _eval(tmp_path / "refused", url, ENV_WITHOUT_KEYS)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"gym-bridge eval: endpoint {url} refused the API key (401): no key was sent"
    )
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "refused" / "gym-logs").exists()
