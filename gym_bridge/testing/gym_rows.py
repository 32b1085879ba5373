"""Rows and configs for Gym tests and benchmarks: the wheel's example rows, row builders, the actor's config.

The fixtures themselves (``ray_session``, ``tiny_tokenizer``, ``scripted_policy``, ``gym_actor``, ...)
are the plugin's (:mod:`gym_bridge.testing`). Ask for them by name; never import one (an imported
fixture would make pytest start a second, module-private Gym).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

from gym_bridge.boundary.files import read_text, write_atomic
from gym_bridge.boundary.json_io import loads, loads_object
from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeouts
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.json_types import JsonObject
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.testing import DEFAULT_GYM_CONFIGS, SERVED_MODEL_NAME
from gym_bridge.types import ActorHandle, DatumSpec, Tokenizer

GYM_CONFIGS = list(DEFAULT_GYM_CONFIGS)
# The smallest Gym set that grades: the model server and the equivalence agent (fault and two-node tests).
EQUIVALENCE_GYM_CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/equivalence_rule/configs/lc.yaml",
]
N = 4  # rows per prompt in make_manager
MAX_EXAMPLE_BYTES = 64 << 20
"""The largest example data file of the wheel read here (they are a few KB to a few MB)."""
TOOL_AGENT = "example_single_tool_call_simple_agent"
EQUIVALENCE_AGENT = "lc_equivalence_rule_simple_agent"


def tool_call_rows() -> list[JsonObject]:
    """The wheel's example rows for example_single_tool_call (weather questions), routed to its agent."""
    from gym_bridge.gym.servers.config_files import wheel_config_path

    path = wheel_config_path("resources_servers/example_single_tool_call/data/example.jsonl")
    text = read_text(path, MAX_EXAMPLE_BYTES)
    rows = [loads_object(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    for row in rows:
        row["agent_ref"] = {"type": "responses_api_agents", "name": TOOL_AGENT}
    return rows


def equivalence_row(question: str, expected_answer: str, agent: str = EQUIVALENCE_AGENT) -> JsonObject:
    """A single-turn equivalence_rule row (the wheel's examples are 8k-token contexts)."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": question}],
            "tools": [],
            "max_output_tokens": 64,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        "expected_answer": expected_answer,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
    }


def stamp(rows: list[JsonObject]) -> list[JsonObject]:
    """Deep copies of ``rows`` with ``_rowidx`` = position."""
    stamped = copy.deepcopy(rows)
    for i, row in enumerate(stamped):
        row["_rowidx"] = i
    return stamped


def gym_actor_config(base_urls: list[str], log_dir: Path | None, **kwargs: Any) -> NemoGymConfig:
    """The actor config of our Gym tests: the wheel's example servers on ``base_urls``, short timeouts."""
    from gym_bridge.gym.servers.config_files import wheel_config_path

    return NemoGymConfig(
        model_name=SERVED_MODEL_NAME,
        base_urls=base_urls,
        config_paths=[str(wheel_config_path(p)) for p in GYM_CONFIGS],
        log_dir=log_dir,
        startup_timeout_s=150,
        shutdown_timeout_s=15,
        request_timeout_s=60,
        actor_options={"num_cpus": 0},
        **kwargs,
    )


def make_manager(
    actor: ActorHandle,
    tokenizer: Tokenizer,
    *,
    rollout_s: float = 30.0,
    max_new_tokens: int = 32,
    seed: int | None = None,
    **policy: Any,
) -> RolloutManager:
    """A manager on one NemoGym actor: N rows per prompt, no retries unless ``policy`` asks for them, rows seeded
    from ``seed`` when given."""
    retry = RolloutRetryPolicy(
        **{
            "max_infra_attempts": 1,
            "max_data_attempts": 1,
            "max_gym_row_attempts": 1,
            "backoff_base_s": 0.2,
            "max_backoff_s": 1.0,
            "max_skipped_prompts": 100,
            "max_consecutive_dropped_prompts": 100,
            **policy,
        }
    )
    return RolloutManager(
        tokenizer,
        {"nemo_gym": actor},
        N,
        4096,
        generation_config={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens},
        use_nemo_gym=True,
        timeouts=RolloutTimeouts(rollout_s=rollout_s),
        retry_policy=retry,
        seed=seed,
    )


def prompt(k: int) -> DatumSpec:
    """Prompt ``k``: an equivalence row whose right answer is ``k``."""
    return datum_from_gym_row(equivalence_row(f"Reply with exactly: {k}", str(k)), idx=k)


_GYM_COLLECT = """
import asyncio, json, os, sys, urllib.request
from urllib.parse import urlsplit
head_url = sys.argv[1]
with urllib.request.urlopen(head_url + "/global_config_dict_yaml", timeout=30) as response:
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.loads(response.read())
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.server_utils import BaseServerConfig
rows = json.loads(sys.stdin.read())
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # Gym's own prints go to stderr

async def main():
    parts = urlsplit(head_url)
    head = BaseServerConfig(host=parts.hostname, port=parts.port)
    results = {}
    for future in RolloutCollectionHelper().run_examples(examples=rows, head_server_config=head):
        row, result = await future
        results[row["_rowidx"]] = result
    answers.write(json.dumps([results[i] for i in range(len(rows))]))

asyncio.run(main())
"""


def gym_token_turns(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each model call's tokens in a Gym result: the output items that carry them."""
    return [
        {key: item[key] for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
        for item in result["response"]["output"]
        if item.get("generation_token_ids")
    ]


def gyms_own_collection(gym_actor: ActorHandle, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows rolled out by Gym's own ``RolloutCollectionHelper.run_examples`` on ``gym_actor``'s servers, in a
    process of its own as a Gym user runs it; results in row order."""
    head = ray.get(gym_actor.server_info.remote())["head"]
    done = subprocess.run(
        [sys.executable, "-c", _GYM_COLLECT, head],
        input=json.dumps(rows),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if done.returncode != 0:
        raise RuntimeError(f"Gym's run_examples failed: {done.stderr[-3000:]}")
    results: list[dict[str, Any]] = loads(done.stdout, "Gym's run_examples output")
    return results


def gym_dataset_collate(
    workdir: Path, config_paths: list[str], *, data: dict[str, list[JsonObject]] | None = None
) -> Path:
    """Rows prepared by Gym 0.7's own ``gym dataset collate`` (``+mode=example_validation``) from the wheel's
    ``config_paths``, run in a scratch copy of their server folders under ``workdir``; ``data`` replaces files of
    those folders first (``{"resources_servers/x/data/example.jsonl": rows}``). Returns the collated file."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    for folder in sorted({"/".join(Path(p).parts[:2]) for p in config_paths}):
        shutil.copytree(site / folder, workdir / folder)
    for relative, rows in (data or {}).items():
        path = workdir / relative
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows), root=workdir)
        path.with_name(f"{path.stem}_metrics.json").unlink(missing_ok=True)  # Gym checks new data against it
    done = subprocess.run(
        [str(Path(sys.executable).with_name("gym")), "dataset", "collate", f"+config_paths=[{','.join(config_paths)}]",
         "+output_dirpath=collated", "+mode=example_validation"],
        cwd=workdir, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"gym dataset collate failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    (collated,) = (workdir / "collated").glob("*.jsonl")
    return collated
