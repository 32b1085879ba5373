"""One context length: ``policy.max_total_sequence_length`` and NeMo-RL's engine copies of it
(``policy.generation.{vllm_cfg,trtllm_cfg,mcore_generation_config}.max_model_len``) have one reader,
``gym_bridge.config.training.context_length``. Its value is the engine's and the server's ``max_model_len`` and the
manager's ``max_seq_len``; keys that agree give it, one key alone gives it, keys that disagree are refused in one
line naming both keys and both values.

Also the training config's ``env.nemo_gym.gym_head`` (a Gym that is already running): accepted instead of
``config_paths``, and the run's policy endpoint read from that Gym's head server (a tiny one started here), refused in
one line unless it is one loopback ``http://HOST:PORT/v1`` that nothing listens on yet."""

from __future__ import annotations

import contextlib
import copy
import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.loading import load_training_config
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.run_settings import grpo_run_settings
from gym_bridge.config.training import ENGINE_CONTEXT_KEYS, context_length, nemo_gym_rollout_settings

DEMO = Path(__file__).resolve().parents[2] / "examples" / "grpo_nemo_gym.yaml"
NEMO_RL_YAML = Path(__file__).parents[1] / "data" / "nemo_rl_grpo_nemo_gym.yaml"
URLS = ["http://127.0.0.1:9/v1"]
VLLM_KEY = "policy.generation.vllm_cfg.max_model_len"


def demo(**keys: Any) -> dict[str, Any]:
    """The train demo's config (``max_total_sequence_length: 256``) with dotted keys set (None: removed)."""
    config = copy.deepcopy(dict(load_with_overrides(DEMO, [])))
    for dotted, value in keys.items():
        *parents, last = dotted.replace("__", ".").split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return config


def everywhere(config: dict[str, Any]) -> set[int]:
    """The context lengths a GRPO run would start with: engine, server and manager (and the Gym path's reader)."""
    settings = grpo_run_settings(config)
    rollout = nemo_gym_rollout_settings(config, base_urls=URLS)
    return {settings.engine.max_model_len, settings.max_model_len, settings.rollout.launch.max_seq_len,
            rollout.launch.max_seq_len, context_length(config)}  # fmt: skip


def test_keys_that_agree_are_the_one_value_of_the_engine_the_server_and_the_manager():
    config = demo(**{"policy.generation.vllm_cfg.max_model_len": 256,
                     "policy.generation.mcore_generation_config.max_model_len": 256})  # fmt: skip
    assert everywhere(config) == {256}
    # NeMo-RL's own recipe writes vllm_cfg.max_model_len: ${policy.max_total_sequence_length}
    nemo_rl = load_training_config(NEMO_RL_YAML)
    assert nemo_rl["policy"]["generation"]["vllm_cfg"]["max_model_len"] == 1024
    assert nemo_gym_rollout_settings(nemo_rl, base_urls=URLS).launch.max_seq_len == 1024


@pytest.mark.parametrize("engine_key", ENGINE_CONTEXT_KEYS)
def test_keys_that_disagree_are_refused_in_one_line_naming_both_keys_and_values(engine_key):
    config = demo(**{engine_key: 384})
    for read in (grpo_run_settings, lambda c: nemo_gym_rollout_settings(c, base_urls=URLS), context_length):
        with pytest.raises(TrainingConfigError) as raised:
            read(config)
        message = str(raised.value)
        assert len(message.splitlines()) == 1
        assert message.startswith(f"policy.max_total_sequence_length (256) and {engine_key} (384) disagree")
    # two engine keys that disagree with each other, the trainer's key absent
    two = demo(**{"policy.max_total_sequence_length": None, VLLM_KEY: 512,
                  "policy.generation.trtllm_cfg.max_model_len": 640})  # fmt: skip
    with pytest.raises(TrainingConfigError, match=rf"^{VLLM_KEY} \(512\) and policy.generation.trtllm_cfg.max_model_len \(640\) disagree"):  # fmt: skip
        context_length(two)


def test_a_disagreement_stops_gym_bridge_train_before_ray_starts(tmp_path, capsys, monkeypatch):
    from gym_bridge import ray_utils
    from gym_bridge.cli import main

    def no_ray(**_: object) -> None:
        raise AssertionError("gym-bridge train started Ray")

    monkeypatch.setattr(ray_utils, "init_ray", no_ray)
    run = tmp_path / "run"
    assert main(["train", str(DEMO), f"+{VLLM_KEY}=512", "--out", str(run)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gym-bridge train: policy.max_total_sequence_length (256) and {VLLM_KEY} (512) disagree")
    assert not run.exists()


def test_one_key_set_alone_is_used_everywhere():
    assert everywhere(demo()) == {256}  # only policy.max_total_sequence_length
    assert everywhere(demo(**{"policy.max_total_sequence_length": None, VLLM_KEY: 320})) == {320}
    mcore = demo(**{"policy.max_total_sequence_length": None, "policy.generation.mcore_generation_config.max_model_len": 192})  # fmt: skip
    assert context_length(mcore) == 192


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"policy.max_total_sequence_length": None}, r"^the training config has no 'policy.max_total_sequence_length'"),
        ({"policy.max_total_sequence_length": 0}, r"^policy.max_total_sequence_length must be a positive integer, got 0$"),
        ({VLLM_KEY: "256"}, rf"^{VLLM_KEY} must be a positive integer, got '256'$"),
        ({VLLM_KEY: True}, rf"^{VLLM_KEY} must be a positive integer, got True$"),
    ],
)
def test_a_missing_or_bad_context_length_is_named(keys, message):
    with pytest.raises(TrainingConfigError, match=message):
        grpo_run_settings(demo(**keys))


# ---- env.nemo_gym.gym_head: a Gym that is already running ----------------------------------------------------------

ATTACHED = {"env.nemo_gym.config_paths": None, "env.nemo_gym.math_with_judge": None,
            "env.nemo_gym.math_with_judge_simple_agent": None}  # fmt: skip
"""The demo's keys that start a Gym of its own (its configs and their overrides): none of them with ``gym_head``."""


@contextlib.contextmanager
def gym_head(global_config: dict[str, Any]) -> Iterator[str]:
    """A head server of a running Gym as far as a training run reads it: ``GET /global_config_dict_yaml`` answers
    ``global_config`` as Gym serves it (its YAML inside a JSON string), on a loopback port; its ``http://host:port``."""
    body = json.dumps(yaml.safe_dump(global_config)).encode()

    class Head(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/global_config_dict_yaml"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Head)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_training_config_naming_a_running_gym_needs_no_config_paths():
    """``env.nemo_gym.gym_head`` stands for ``config_paths``; whatever would change that Gym's config is refused."""
    config = demo(**ATTACHED, **{"env.nemo_gym.gym_head": "http://127.0.0.1:11000"})
    settings = grpo_run_settings(config)
    assert settings.gym_head == "http://127.0.0.1:11000" and settings.rollout.launch.gym.config_paths == []
    assert settings.rollout.launch.gym.servers_config().head_url == "http://127.0.0.1:11000"
    # the run's server is named where the Gym calls, under the model the Gym asks for
    served = settings.serving_at(["http://127.0.0.1:8000/v1"], "gym-policy")
    assert served.served_model_name == "gym-policy" and served.rollout.launch.gym.model_name == "gym-policy"
    assert served.rollout.launch.gym.base_urls == ["http://127.0.0.1:8000/v1"]
    with pytest.raises(TrainingConfigError, match=r"^the training config has no 'env.nemo_gym.config_paths'"):
        grpo_run_settings(demo(**ATTACHED))
    for extra, key in [({"env.nemo_gym.config_paths": ["a.yaml"]}, "config_paths"),
                       ({"env.nemo_gym.math_with_judge": {"x": 1}}, "overrides"),
                       ({"env.nemo_gym.model_server": "gym_bridge"}, "model_server")]:  # fmt: skip
        with pytest.raises(TrainingConfigError) as raised:
            grpo_run_settings(demo(**{**ATTACHED, "env.nemo_gym.gym_head": "http://127.0.0.1:11000", **extra}))
        (line,) = str(raised.value).splitlines()
        assert line.startswith("env.nemo_gym: gym_head: a running Gym keeps the config") and key in line, line
    with pytest.raises(TrainingConfigError, match=r"gym_head: a running Gym's head server is given as http://host"):
        grpo_run_settings(demo(**ATTACHED, **{"env.nemo_gym.gym_head": "127.0.0.1:11000"}))


def test_the_early_checks_leave_the_agents_to_the_running_gym(tmp_path):
    """The rows name an agent no config of the run defines: the running Gym's agents route them once attached."""
    from gym_bridge.config.run_settings import grpo_run_keys
    from gym_bridge.recipes.pre_start import check_before_start

    with pytest.raises(TrainingConfigError, match=r"names agent\(s\) .* that no config in env.nemo_gym.config_paths"):
        check_before_start(grpo_run_keys(demo(**{"env.nemo_gym.config_paths": [
            "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"]})))  # fmt: skip
    check_before_start(grpo_run_keys(demo(**ATTACHED, **{"env.nemo_gym.gym_head": "http://127.0.0.1:11000"})))


def test_the_run_serves_where_the_running_gym_calls_under_its_model_name():
    from gym_bridge.recipes.grpo_run import PolicyAddress, running_gym_policy

    config = {"policy_base_url": ["http://127.0.0.1:18000/v1"], "policy_model_name": "gym-policy"}
    with gym_head(config) as head:
        assert running_gym_policy(head, "smollm2") == PolicyAddress(
            "http://127.0.0.1:18000/v1", "127.0.0.1", 18000, "gym-policy", head
        )
    for url, host in [("http://localhost:18001/v1/", "localhost"), ("http://[::1]:18002/v1", "::1")]:
        with gym_head({"policy_base_url": url}) as head:  # Gym's string form; no policy_model_name: policy.model_name
            address = running_gym_policy(head, "smollm2")
        assert (address.host, address.model_name) == (host, "smollm2")


@pytest.mark.parametrize(
    ("policy_base_url", "why"),
    [
        (["http://10.1.2.3:8000/v1"], r"'http://10.1.2.3:8000/v1' \(its policy_base_url\), whose host 10.1.2.3 is not "
                                      r"this machine's loopback .*the run serves its policy on this machine"),
        ("http://gpu-0:8000/v1", r"whose host gpu-0 is not this machine's loopback"),
        (["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"], r"\['http://127.0.0.1:8000/v1', "
                                                                   r"'http://127.0.0.1:8001/v1'\] .*one policy_base_url"),
        (["https://127.0.0.1:8000/v1"], r"which is not an http://HOST:PORT/v1 URL"),
        (["http://127.0.0.1/v1"], r"which names no port"),
        (["http://127.0.0.1:8000"], r"whose path is not /v1"),
    ],
)
def test_a_running_gym_calling_elsewhere_than_one_loopback_endpoint_is_refused_in_one_line(policy_base_url, why):
    from gym_bridge.recipes.grpo_run import running_gym_policy

    with gym_head({"policy_base_url": policy_base_url, "policy_model_name": "m"}) as head:
        with pytest.raises(TrainingConfigError) as raised:
            running_gym_policy(head, "smollm2")
    (line,) = str(raised.value).splitlines()
    assert line.startswith(f"env.nemo_gym.gym_head: the running NeMo-Gym at {head} calls its policy at "), line
    assert re.search(why, line), line


def test_a_running_gym_calling_elsewhere_stops_train_before_ray_starts(tmp_path, monkeypatch):
    """The endpoint check runs with the other checks, before Ray, Gym or a model start, and no run folder is made."""
    from gym_bridge import ray_utils
    from gym_bridge.recipes.train import train

    def no_ray(**_: object) -> None:
        raise AssertionError("gym-bridge train started Ray")

    monkeypatch.setattr(ray_utils, "init_ray", no_ray)
    run = tmp_path / "run"
    with gym_head({"policy_base_url": ["http://10.1.2.3:8000/v1"], "policy_model_name": "m"}) as head:
        with pytest.raises(TrainingConfigError, match=r"^env\.nemo_gym\.gym_head: .* whose host 10\.1\.2\.3 is not"):
            train(demo(**ATTACHED, **{"env.nemo_gym.gym_head": head}), run, progress=False, list_gpu_keys=False)
    assert not run.exists()


def test_a_busy_policy_port_stops_the_run_before_a_model_loads(tmp_path, monkeypatch):
    """Something listens where the running Gym calls: one line naming the URL, before the engine is built."""
    from gym_bridge.generation import hf
    from gym_bridge.recipes import grpo_run
    from gym_bridge.serving.listen import ServerBindError, listening_socket

    def no_engine(*_: object, **__: object) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr(hf, "HFGeneration", no_engine)  # the one builder (recipes/engine_server.py) builds it there
    taken = listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{taken.getsockname()[1]}/v1"
    try:
        with gym_head({"policy_base_url": [url], "policy_model_name": "m"}) as head:
            settings = grpo_run_settings(demo(**ATTACHED, **{"env.nemo_gym.gym_head": head}))
            with pytest.raises(ServerBindError) as raised:
                grpo_run.start_grpo_run(settings, tmp_path / "run")
    finally:
        taken.close()
    (line,) = str(raised.value).splitlines()
    assert line == (f"the running NeMo-Gym at {head} calls its policy at {url}, where this run would serve it, but "
                    "something already listens there: stop it, or start the Gym with another policy_base_url")  # fmt: skip
    # the port is free again once that process is gone: the run claims it
    address = grpo_run.PolicyAddress(url, "127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]), "m", head)
    grpo_run.claim_policy_address(address).close()


def test_a_head_that_does_not_answer_is_one_line_naming_it():
    from gym_bridge.failures import GymStartupError
    from gym_bridge.gym.servers.reaper import free_port
    from gym_bridge.gym.servers.running import read_policy_endpoint

    head = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(GymStartupError, match=rf"^could not read /global_config_dict_yaml from the NeMo-Gym head "
                                              rf"server at {head}: "):  # fmt: skip
        read_policy_endpoint(head, timeout_s=5)
    with gym_head({"policy_model_name": "m"}) as head, pytest.raises(GymStartupError, match="names no policy endpoint"):
        read_policy_endpoint(head)


def test_the_engine_context_keys_have_one_reader_for_the_config_and_the_rollout():
    """NeMo-RL's engine ``max_model_len`` keys, in its order: the config's context length and the rollout's engine
    limit read them through one function."""
    from types import SimpleNamespace

    from gym_bridge.rollout.nemo_gym_batch_input import engine_context_lengths, engine_max_model_len

    generation = {"vllm_cfg": {"max_model_len": None}, "trtllm_cfg": {"max_model_len": 64}, "mcore_generation_config": 3}
    assert engine_context_lengths(generation) == {"trtllm_cfg.max_model_len": 64}
    assert engine_max_model_len(SimpleNamespace(cfg=generation), 32) == 64
    assert engine_max_model_len(SimpleNamespace(cfg={"max_total_sequence_length": 16}), 32) == 16
    assert engine_max_model_len(object(), 32) == 32
    config = demo(**{"policy.generation.trtllm_cfg": {"max_model_len": 128}})
    with pytest.raises(TrainingConfigError, match=r"policy.generation.trtllm_cfg.max_model_len \(128\) disagree"):
        context_length(config)
