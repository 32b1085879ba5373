"""``gym-bridge train`` as a user runs it, on a config whose only content is ``defaults:`` (the train-demo's YAML) and
two keys: one real GRPO step of SmolLM2 through real Ray, real NeMo-Gym servers (math_with_judge) and our server,
with TensorBoard, W&B and MLflow on, its Gym resources server SIGKILLed as the step's rollouts start (Gym restarts
it). One run is made for the module; every test reads it: the scalars read back
with each logger's own reader, no connection that left loopback, the training plots, and the checkpoint loaded with
``from_pretrained``, served, evaluated through real Gym beside the base model and compared with an interval.

Every Python process of the run (the command, Ray's workers, Gym's servers) loads a ``sitecustomize`` that refuses
and records any ``connect`` to an address that is not loopback; W&B is not told to be offline by the test (the
command makes it so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from gym_bridge.eval.runs import load_run
from gym_bridge.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "grpo_nemo_gym.yaml"
HELDOUT = REPO / "examples" / "eval_arith_heldout.yaml"
HELDOUT_ROWS = 8
VAL_ROWS = 4

pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

GUARD = r'''
"""Test guard: refuse and record every connect() to an address that is not loopback (tests/recipes/test_train_command.py)."""
import ipaddress
import os
import socket

_LOG = os.environ["GYM_BRIDGE_NET_GUARD_LOG"]
_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex


def _note(line):
    with open(_LOG, "a") as f:
        f.write(line + "\n")


def _check(sock, address):
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    host = str(address[0]).split("%")[0]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        import traceback

        _note(f"refused {os.getpid()} {address!r} from:\n" + "".join(traceback.format_stack()))
        raise ConnectionRefusedError(f"test guard: {address!r} is not loopback")


def connect(self, address):
    _check(self, address)
    return _connect(self, address)


def connect_ex(self, address):
    _check(self, address)
    return _connect_ex(self, address)


socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
_note(f"loaded {os.getpid()}")
'''


def guarded_env(folder: Path) -> tuple[dict[str, str], Path]:
    """The environment of a guarded command, and the guard's log."""
    guard = folder / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    log = folder / "net-guard.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(guard), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "GYM_BRIDGE_NET_GUARD_LOG": str(log),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("WANDB_MODE", None)
    return env, log


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=REPO, env=env or {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, timeout=timeout)


GRADER_LOG = "gym-logs/math_with_judge.log"


def kill_the_grader_after_validation(run: Path, timeout_s: float = 1200) -> None:
    """SIGKILL the run's math_with_judge resources server once the first validation is written, as the step's
    rollouts start: Gym restarts it and the step goes on (``test_the_killed_grader_was_restarted``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics, log = run / "metrics.jsonl", run / GRADER_LOG
        if metrics.exists() and metrics.read_text().strip() and log.exists():
            pids = re.findall(r"Started server process \[(\d+)\]", log.read_text())
            if pids:
                os.kill(int(pids[-1]), signal.SIGKILL)
                return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, object]:
    """One ``gym-bridge train`` step: the config file is ``defaults:`` plus two keys; the command line shrinks the
    step and turns the three loggers on (``++``: NeMo-RL's add-or-change, the demo has no ``logger`` section)."""
    folder = tmp_path_factory.mktemp("train")
    config = folder / "train.yaml"
    config.write_text(f"defaults: {DEMO}\ngrpo:\n  max_num_steps: 1\n  num_prompts_per_step: 1\n")
    env, guard_log = guarded_env(folder)
    run = folder / "run"
    started = time.perf_counter()
    killer = threading.Thread(target=kill_the_grader_after_validation, args=(run,), daemon=True)
    killer.start()
    done = cli(
        "train", str(config),
        "grpo.num_generations_per_prompt=8", "++grpo.batch_multiplier=2", f"grpo.max_val_samples={VAL_ROWS}",
        "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
        "++logger.tensorboard_enabled=true", "++logger.wandb_enabled=true", "++logger.mlflow_enabled=true",
        "--out", str(run), env=env, timeout=1500,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    killer.join(5)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"gym-bridge train, one step with validation at start and end: {seconds:.0f} s")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"run": run, "done": done, "lines": lines, "guard_log": guard_log, "folder": folder}


def train_line(trained: dict) -> dict:
    (line,) = [m for m in trained["lines"] if m["kind"] == "train"]
    return line


def test_a_config_of_defaults_and_two_keys_trains_one_step(trained: dict) -> None:
    line = train_line(trained)
    assert line["step"] == 0 and not line["train/skipped_zero_advantage"], "dynamic sampling found a reward spread"
    assert line["train/refit"] and line["train/policy_step_abs_diff_mean"] > 0, "the optimizer step moved the policy"
    assert [m["step"] for m in trained["lines"] if m["kind"] == "val"] == [0, 1]
    as_trained = yaml.safe_load((trained["run"] / "config.yaml").read_text())
    assert as_trained["grpo"]["max_num_steps"] == 1 and as_trained["policy"]["model_name"] == "smollm2"
    assert as_trained["grpo"]["num_generations_per_prompt"] == 8 and as_trained["logger"]["mlflow_enabled"] is True
    assert "train: 100%" in trained["done"].stderr and "1/1" in trained["done"].stderr, "the progress bar"
    assert f"checkpoint: {trained['run'] / 'checkpoint'}" in trained["done"].stdout
    logs = sorted(p.name for p in (trained["run"] / "gym-logs").rglob("*.log"))
    assert any(name.startswith("math_with_judge") for name in logs), f"Gym's logs are in the run folder: {logs}"


def test_the_killed_grader_was_restarted(trained: dict) -> None:
    """The resources server killed as the step's rollouts started was started again, and the step trained on
    graded completions (``test_a_config_of_defaults_and_two_keys_trains_one_step`` reads the step)."""
    log = (trained["run"] / GRADER_LOG).read_text()
    assert "math_with_judge exited with code -9; restarting it (1 of 3)" in log, log[-3000:]
    assert log.count("Started server process") == 2, "started once, restarted once"


def test_a_config_without_policy_model_name_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "no_model.yaml"
    config.write_text(f"defaults: {DEMO}\npolicy:\n  _override_: true\n  max_total_sequence_length: 256\n")
    done = cli("train", str(config), "--out", str(tmp_path / "run"), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gym-bridge train: the training config has no 'policy.model_name' (NeMo-RL's GRPO recipes set it)"
    ]
    assert not (tmp_path / "run").exists(), "nothing started"
    unknown = cli("train", str(DEMO), "grpo.max_num_stepz=1", "--out", str(tmp_path / "run"), timeout=120)
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert "grpo.max_num_stepz" in unknown.stderr and "+grpo.max_num_stepz" in unknown.stderr


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B offline run file (``run-*.wandb``: W&B's LevelDB-style record log of protobuf
    ``Record``s, read with W&B's own protobuf classes)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            pos += left - 7
            continue
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_scalars_read_back_from_tensorboard_mlflow_and_wandb(trained: dict) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    line = train_line(trained)
    val_end = [m for m in trained["lines"] if m["kind"] == "val"][-1]
    expected = {
        ("train/loss", 1): line["train/loss"],
        ("train/reward", 1): line["train/mean_reward"],
        ("timing/train/total_step_time", 1): line["time/step_s"],
        ("validation/accuracy", 1): val_end["val/accuracy"],
    }
    per_agent = [key for key in line if key.startswith("train/") and key.endswith("/reward/mean") and key.count("/") == 3]
    assert per_agent, "the step's per-environment metrics (train/<agent>/reward/mean) are in metrics.jsonl"
    expected.update({(key, 1): line[key] for key in per_agent})
    logs = trained["run"] / "logs"

    events = EventAccumulator(str(logs / "tensorboard"))
    events.Reload()
    for (name, step), value in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(name) if e.step == step] == [
            (step, pytest.approx(value, rel=1e-6))
        ]

    client = MlflowClient(tracking_uri=f"sqlite:///{logs / 'mlflow' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "gym-bridge"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    for (name, step), value in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name) if m.step == step] == [
            (step, pytest.approx(value, rel=1e-6))
        ]

    (run_file,) = (logs / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    for (name, step), value in expected.items():
        assert [row[name] for row in rows if row.get("_step") == step and name in row] == [
            pytest.approx(value, rel=1e-6)
        ]
    assert not list((logs / "wandb" / "wandb").glob("run-*")), "an online run folder: W&B tried the service"


RAY_CLOUD_PROBE = "in get_cloud_from_metadata_requests"
"""Ray's dashboard process (started even with ``include_dashboard=False``, for its usage-stats module) asks the
cloud metadata address (169.254.169.254) which cloud it runs on before it reads ``RAY_USAGE_STATS_ENABLED=0``
(``ray/_common/usage/usage_lib.py``: ``get_cluster_config_to_report``); Ray has no setting that skips it. The guard
refuses it like any other; it is the one attempt this test tolerates, and only from that function."""


def test_no_connection_left_loopback(trained: dict) -> None:
    """Every non-loopback connect was refused by the guard, and none came from W&B, MLflow, Gym or gym-bridge."""
    blocks = [b for b in ("\n" + trained["guard_log"].read_text()).split("\nrefused ")[1:]]
    notes = trained["guard_log"].read_text().splitlines()
    loaded = {note.split()[1] for note in notes if note.startswith("loaded ")}
    assert len(loaded) >= 3, f"the guard ran in the command, Ray's workers and Gym's servers: {len(loaded)}"
    others = [block for block in blocks if RAY_CLOUD_PROBE not in block]
    assert others == [], "\n\n".join(others)


def test_report_rebuilds_the_plots_and_escapes_the_run_folder(trained: dict, tmp_path: Path) -> None:
    run = trained["run"]
    assert (run / "training.png").stat().st_size > 10_000 and "held-out" in (run / "training.html").read_text()
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(run / "metrics.jsonl", copy / "metrics.jsonl")
    hostile = "<script>alert(1)</script>"
    rows = [json.loads(x) for x in (run / "val_results.jsonl").read_text().splitlines()]
    with (copy / "val_results.jsonl").open("w") as out:
        for row in rows:
            out.write(json.dumps({**row, "set": hostile}) + "\n")
    done = cli("report", str(copy), timeout=120)
    assert done.returncode == 0, done.stderr
    page = (copy / "training.html").read_text()
    assert (copy / "training.png").exists() and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert hostile not in page
    with (copy / "val_results.jsonl").open("a") as out:  # a malformed line is named, never skipped
        out.write("{torn line\n")
    refused = cli("report", str(copy), timeout=120)
    assert refused.returncode == 2 and f"val_results.jsonl:{len(rows) + 1}: not valid JSON" in refused.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_checkpoint_loads_and_serves(trained: dict) -> None:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from gym_bridge.models.registry import resolve_model_path

    checkpoint = trained["run"] / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2"), dtype=torch.float32)
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed, "the trained weights differ from the base model's"
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "gym_bridge.cli", "serve", "--model", str(checkpoint), "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [str(checkpoint)]
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": str(checkpoint), "messages": [{"role": "user", "content": "What is 2 + 3?"}],
                  "max_tokens": 8, "temperature": 0},
            timeout=120,
        ).json()  # fmt: skip
        assert answer["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_checkpoint_and_base_evaluate_through_gym_and_compare(
    trained: dict, tmp_path: Path, eval_ray_env: dict[str, str]
) -> None:
    """The held-out eval example for both policies in one command (a Gym set each), then compare. The command joins
    the evals' shared Ray (``eval_ray_env``); the training run keeps a Ray of its own, whose every process the
    network guard covers."""
    checkpoint = trained["run"] / "checkpoint"
    config = yaml.safe_load(HELDOUT.read_text())
    config.pop("embedded_policy")
    config.update(
        output_dir=str(tmp_path / "heldout"),
        limit=HELDOUT_ROWS,
        num_generations_per_prompt=2,
        policies=[
            {"name": "base", "embedded_policy": "smollm2"},
            {"name": "trained", "embedded_policy": str(checkpoint)},
        ],
    )
    path = tmp_path / "heldout.yaml"
    path.write_text(yaml.safe_dump(config))
    done = cli("eval", str(path), "--no-progress", env=eval_ray_env, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    base, trained_run = tmp_path / "heldout" / "base", tmp_path / "heldout" / "trained"
    assert json.loads((trained_run / "run.json").read_text())["config"]["embedded_policy"] == str(checkpoint)

    compared = cli("compare", str(base), str(trained_run), "--out", str(tmp_path / "cmp"), timeout=300)
    assert compared.returncode == 0, compared.stderr
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["shared_prompts"] == HELDOUT_ROWS
    reward = report["comparisons"][0]["agents"]["all"]["metrics"]["mean_reward"]
    assert reward["low"] <= reward["diff"] <= reward["high"]
    means = {}
    for name, run in (("base", base), ("trained", trained_run)):
        groups = load_run(run).groups
        assert len(groups) == HELDOUT_ROWS and all(len(g.rewards) == 2 for g in groups)
        means[name] = sum(sum(g.rewards) / len(g.rewards) for g in groups) / len(groups)
    assert reward["diff"] == pytest.approx(means["trained"] - means["base"])
    print(f"held-out mean reward, trained - base: {reward['diff']:+.3f} [{reward['low']:+.3f}, {reward['high']:+.3f}]")
