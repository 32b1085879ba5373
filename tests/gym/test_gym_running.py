"""A NeMo-Gym that is already running (issue 50, item 6): ``gym-bridge eval ... gym_head=http://host:port``.

As ``gym eval run --no-serve`` does, the run uses the servers and the config of the Gym whose head server it is given
(read from ``/server_instances`` and ``/global_config_dict_yaml``), starting none and stopping none. The Gym test
starts our policy endpoint (``gym-bridge serve --policy scripted``) and Gym's own ``gym env start`` pointed at it, as
subprocesses on loopback ports claimed here, runs an eval against that Gym (ordinary rows and a materialized row, whose
taskset route comes from the running Gym's config), and checks the Gym's processes are all still running afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gym_bridge.eval.config import EvalConfigError, build_config
from gym_bridge.failures import GymStartupError, SettingError
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.servers.reaper import PORT_WINDOW, free_port, release, reserve_port_window
from gym_bridge.gym.servers.server_config import GymServersConfig, HeadServerAddress, head_address
from gym_bridge.gym.servers.server_set import GymServers
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym_versions import installed_gym
from gym_bridge.testing import SERVED_MODEL_NAME, wait_until
from gym_bridge.testing.gym_rows import TOOL_AGENT, tool_call_rows

ENVIRONMENT_DIR = Path(__file__).parents[1] / "data" / "episode_environment"
GYM_CONFIGS = [
    str(wheel_config_path("responses_api_models/vllm_model/configs/vllm_model_for_training.yaml")),
    str(wheel_config_path("resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml")),
]
SERVER_FOLDERS = [
    "responses_api_models/vllm_model",
    "resources_servers/example_single_tool_call",
    "responses_api_agents/simple_agent",
    "environment_servers/legacy_agent",
    "environment_servers/episode_environment",
]
"""The server folders of that Gym set: each gets a venv link to this interpreter's environment (nothing installed)."""
_NO_RAY = """\
import os
if os.environ.get("GYM_BRIDGE_NO_RAY") == "1":
    import ray
    ray.is_initialized = lambda: True  # Gym's initialize_ray() then neither starts nor joins a cluster
"""


# ---- the key, the settings, the bounds ---------------------------------------------------------------------------


def test_the_head_is_given_as_http_host_port():
    assert head_address("http://127.0.0.1:11000") == HeadServerAddress("127.0.0.1", 11000)
    assert head_address("http://gym-head:8080/").url == "http://gym-head:8080"
    for bad in ("127.0.0.1:11000", "http://127.0.0.1", "https://h:1", "http://h:1/v1", "http://h:notaport", ""):
        with pytest.raises(SettingError, match=r"given as http://host:port .*got"):
            head_address(bad)


def test_a_running_gym_takes_no_config_of_ours():
    config = NemoGymConfig(model_name="tiny", base_urls=["http://127.0.0.1:1/v1"], gym_head="http://127.0.0.1:2")
    servers = config.servers_config()
    assert servers.head_url == "http://127.0.0.1:2" and not servers.overrides and not servers.config_paths
    for change in ({"config_paths": ["x.yaml"]}, {"overrides": {"a": 1}}, {"model_server": "gym_bridge"},
                   {"port_range_low": 20000, "port_range_high": 20100}):  # fmt: skip
        with pytest.raises(ValueError, match=rf"gym_head: a running Gym keeps the config .*{next(iter(change))}"):
            NemoGymConfig(model_name="tiny", base_urls=["http://127.0.0.1:1/v1"], gym_head="http://127.0.0.1:2",
                          **change)  # fmt: skip
    with pytest.raises(ValueError, match=r"head_url: a running Gym keeps .*config_paths, overrides"):
        GymServersConfig(head_url="http://127.0.0.1:2", config_paths=["x.yaml"], overrides={"a": 1})


def test_the_eval_key(tmp_path):
    data = {
        "dataset": str(tmp_path / "rows.jsonl"),
        "output_dir": str(tmp_path / "run"),
        "base_urls": ["http://127.0.0.1:1/v1"],
    }
    with pytest.raises(EvalConfigError, match=r"config_paths: no Gym server config; give config_paths .*or gym_head"):
        build_config(data)
    config = build_config(data, ["gym_head=http://127.0.0.1:2"])
    assert config.gym_head == "http://127.0.0.1:2" and config.config_paths == []
    assert config.fingerprint("sha")["gym_head"] == "http://127.0.0.1:2"
    assert "gym_head" not in build_config({**data, "config_paths": ["a.yaml"]}).fingerprint("sha")
    without_policy = {key: value for key, value in data.items() if key != "base_urls"}
    for base, overrides, message in [
        (data, ["gym_head=127.0.0.1:2"], r"gym_head: a running Gym's head server is given as http://host:port"),
        (data, ["gym_head=http://h:2", "config_paths=[a.yaml]"], r"gym_head: .* config_paths would change it"),
        (data, ["gym_head=http://h:2", "gym_overrides={a: 1}"], r"gym_head: .* gym_overrides would change it"),
        (without_policy, ["gym_head=http://h:2"], r"gym_head: a running Gym's model server calls the endpoint"),
        (without_policy, ["gym_head=http://h:2", "policies=[{name: a, base_urls: [http://h:1/v1]}]"], "several"),
    ]:
        with pytest.raises(EvalConfigError, match=message):
            build_config(base, overrides)


def test_a_head_that_does_not_answer_fails_the_start_in_time_and_nothing_is_stopped(tmp_path):
    port = free_port("127.0.0.1")
    servers = GymServers(GymServersConfig(head_url=f"http://127.0.0.1:{port}", startup_timeout_s=2, log_dir=tmp_path))
    with pytest.raises(GymStartupError, match=rf"head server at http://127.0.0.1:{port} did not answer GET "
                                              r"/\S* with 200 within the 2(\.0)?s start-up deadline"):  # fmt: skip
        servers.start()
    assert not servers.attached and servers.pids() == set()
    servers.stop()  # nothing to stop


# ---- against Gym's own `gym env start` ---------------------------------------------------------------------------


class _Service:
    """One command in a session of its own, logged to a file; :meth:`wait` until ``url`` answers 200 (bounded),
    :meth:`stop` ends its process group (SIGTERM, then SIGKILL), bounded."""

    def __init__(self, name: str, command: list[str], log: Path, *, cwd: Path | None = None, env: Any = None) -> None:
        self.name, self.log = name, log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait(self, url: str, timeout_s: float) -> None:
        def answering() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(answering, timeout_s, f"the {self.name} answers {url}", poll_s=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}:\n{self.tail()}") from None

    def processes(self) -> list[psutil.Process]:
        """The command's process and every descendant (a Gym set: the head and each server)."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> None:
        for signum, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        with contextlib.suppress(ProcessLookupError):  # servers the group leader left behind
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


@pytest.fixture
def policy_endpoint(tmp_path: Path, tiny_model_dir: Path) -> Iterator[str]:
    """``gym-bridge serve --policy scripted`` on a claimed loopback port; its ``/v1`` URL."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "gym_bridge.cli", "serve", "--model", str(tiny_model_dir), "--policy", "scripted",
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_MODEL_NAME]  # fmt: skip
    service = _Service("policy endpoint", command, tmp_path / "serve.log")
    try:
        service.wait(f"http://127.0.0.1:{port}/v1/models", timeout_s=180)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        service.stop()


@contextlib.contextmanager
def gym_env_start(
    tmp_path: Path, policy_url: str, *, model_name: str = SERVED_MODEL_NAME, episodes: bool = True, ready: bool = True
) -> Iterator[tuple[str, _Service]]:
    """Gym's own ``gym env start`` on a port window claimed here (the head at its first port), its model server
    pointed at ``policy_url`` and asking for ``model_name``, with our episode environment server's folder in its
    working folder (``episodes``: and its config started); the head URL and the service, once the head server says
    it is ready (``ready``; Gym 0.7 says so once ``policy_url`` answers), else once it serves its config. Its servers
    run on this interpreter's environment (venv links, no installs) and without Ray."""
    window = reserve_port_window()
    owner = object()
    work = tmp_path / "gym-cwd"
    (work / "environment_servers").mkdir(parents=True)
    (work / "environment_servers" / "episode_environment").symlink_to(ENVIRONMENT_DIR, target_is_directory=True)
    venvs, shim = tmp_path / "venvs", tmp_path / "no-ray"
    for folder in SERVER_FOLDERS:
        (venvs / folder).mkdir(parents=True)
        (venvs / folder / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_NO_RAY)
    configs = [*GYM_CONFIGS, *([str(ENVIRONMENT_DIR / "configs" / "episode_environment.yaml")] if episodes else [])]
    command = [str(Path(sys.executable).parent / "gym"), "env", "start"]
    command += [arg for path in configs for arg in ("--config", path)]
    command += [
        "+head_server.host=127.0.0.1",
        f"+head_server.port={window}",
        "+default_host=127.0.0.1",
        f"+port_range_low={window + 1}",
        f"+port_range_high={window + PORT_WINDOW - 1}",
        "+skip_venv_if_present=true",
        f"+uv_venv_dir={venvs}",
        f"+policy_base_url=[{policy_url}]",
        f"+policy_model_name={model_name}",
        "+policy_api_key=dummy_key",
    ]
    env = {**os.environ, "PYTHONPATH": str(shim), "GYM_BRIDGE_NO_RAY": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    service = _Service("gym env start", command, tmp_path / "gym.log", cwd=work, env=env)
    head = f"http://127.0.0.1:{window}"
    try:
        service.wait(head + (installed_gym().head_readiness_path if ready else "/global_config_dict_yaml"), 300)
        yield head, service
    finally:
        service.stop()
        release(owner, window)  # type: ignore[arg-type]


@pytest.fixture
def running_gym(tmp_path: Path, policy_endpoint: str) -> Iterator[tuple[str, _Service]]:
    """:func:`gym_env_start` pointed at ``policy_endpoint`` (``gym-bridge serve --policy scripted``), with our
    episode environment server; the head URL and the service."""
    with gym_env_start(tmp_path, policy_endpoint) as gym:
        yield gym


@pytest.mark.gym
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not installed_gym().episode_protocol, reason=f"{installed_gym().label}: `gym env start` is 0.7's")
def test_an_eval_uses_a_running_gym_and_leaves_it_running(
    ray_session, running_gym, policy_endpoint, tiny_model_dir, tmp_path
):
    from gym_bridge.eval.runner import run_eval

    head, gym = running_gym
    gym_processes = gym.processes()
    assert len(gym_processes) >= 7, [p.cmdline()[-2:] for p in gym_processes]  # the CLI plus six servers
    rows = tool_call_rows()[:2]
    for row in rows:
        row["agent_ref"] = {"name": TOOL_AGENT}
    task_input = {key: value for key, value in tool_call_rows()[2].items() if key != "agent_ref"}
    rows.append({"task_id": {"taskset": "weather", "task_id": "sf-2"}, "task_input": task_input})
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = {
        "dataset": str(dataset),
        "output_dir": str(tmp_path / "run"),
        "base_urls": [policy_endpoint],
        "model_name": SERVED_MODEL_NAME,
        "tokenizer": str(tiny_model_dir),
        "num_generations_per_prompt": 2,
        "concurrency": 2,
        "max_new_tokens": 64,
        "max_seq_len": 2048,
        "startup_timeout_s": 120,
        "request_timeout_s": 120,
        "rollout_timeout_s": 240,
    }
    config = build_config(data, [f"gym_head={head}"])  # the CLI's override: gym-bridge eval cfg.yaml gym_head=...

    outcome = run_eval(config, progress=False)

    assert (outcome.done_now, outcome.failed_now, outcome.prompts_total) == (3, 0, 3)
    results = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    rewards = {r["prompt_idx"]: [c["reward"] for c in r["completions"]] for r in results}
    assert rewards == {0: [1.0, 1.0], 1: [1.0, 1.0], 2: [1.0, 1.0]}, "the scripted policy calls the weather tool"
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["gym_head"] == head and run["config"]["config_paths"] == []
    assert not (tmp_path / "run" / "gym-logs").exists(), "no Gym server of this run: nothing logged"
    # the running Gym is as it was: every process alive, its head ready, nothing new started for the run
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in gym_processes)
    assert httpx.get(head + installed_gym().head_readiness_path, timeout=5, trust_env=False).status_code == 200


# ---- a training run against Gym's own `gym env start` ------------------------------------------------------------


@pytest.fixture
def gym_calling_a_free_port(tmp_path: Path) -> Iterator[tuple[str, _Service, str]]:
    """:func:`gym_env_start` whose model server calls ``http://127.0.0.1:PORT/v1`` on a port claimed free here, where
    nothing listens yet (a training run serves its policy there), without the episode environment; the head URL, the
    service and that URL, once the head server serves its config (Gym 0.7 says it is ready only once that endpoint
    answers: it waits for it, 600 s by default, as it would for a vLLM still loading)."""
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"
    with gym_env_start(tmp_path, url, episodes=False, ready=False) as (head, gym):
        yield head, gym, url


@pytest.mark.gym
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not installed_gym().episode_protocol, reason=f"{installed_gym().label}: `gym env start` is 0.7's")
def test_a_training_run_serves_where_a_running_gym_calls_and_leaves_it_running(
    ray_session, gym_calling_a_free_port, tiny_model_dir, tmp_path
):
    """``gym-bridge train`` with ``env.nemo_gym.gym_head``: the run's server listens at the running Gym's
    ``policy_base_url`` under its ``policy_model_name`` (not ``policy.model_name``, a folder here), one GRPO step
    runs through that Gym's servers, and every process of that Gym still runs afterwards."""
    from gym_bridge.recipes.train import train

    head, gym, url = gym_calling_a_free_port
    gym_processes = gym.processes()
    rows = tool_call_rows()[:2]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config: dict[str, Any] = {
        "use_nemo_gym": True,
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 1, "seed": 0},
        "policy": {
            "model_name": str(tiny_model_dir),
            "max_total_sequence_length": 2048,
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0},
        },
        "checkpointing": {"enabled": False},
        "env": {
            "nemo_gym": {
                "gym_head": head,
                "rollout_timeout_s": 240,
                "startup_timeout_s": 120,
                "actor_options": {"num_cpus": 0},
            }
        },
        "data": {"train": {"data_path": str(data)}},
    }
    run = tmp_path / "run"

    outcome = train(config, run, progress=False)

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (step,) = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in outcome.lines] == [0], "one step, the first"
    assert (step["train/groups"], step["train/samples"]) == (2, 4), step
    assert isinstance(step["train/mean_reward"], float) and f"train/{TOOL_AGENT}/reward/mean" in step, step
    # every sample's tokens came from the run's engine: Gym's model server called the run's server, by the name
    # the Gym asks for (policy_model_name "tiny"; policy.model_name is a folder, a name the server does not serve)
    assert step["train/mean_generated_tokens"] > 0, step
    assert not (run / "gym-logs").exists(), "no Gym server of this run: nothing logged"
    # the running Gym is as it was: every process alive, its head ready; the run's server is gone from its port
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in gym_processes)
    assert httpx.get(head + installed_gym().head_readiness_path, timeout=5, trust_env=False).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5, trust_env=False)
