"""``gym-bridge rescore RUN``: Gym's own grading again on a finished run's stored responses, under the run's
grader settings or changed ones, into a new run folder; nothing is generated again.

Each stored completion is sent, unchanged, to its resources server's ``POST /verify`` as NeMo-Gym's own
``reverify`` sends it: the dataset row (falling back to the stored Gym result's fields when the dataset file
is gone or changed) with the stored ``responses_create_params`` and ``response``. The agent's resources
server comes from the config's agent blocks. A server that says its verify cannot be repeated
(``GET /reverify_mode`` = ``unsupported``) is not asked.

What a rescore takes from the source folder is data only (:mod:`gym_bridge.eval.rescore_trust`:
:func:`trusted_config_files`, :func:`check_stored_overrides`): the stored responses and the grader settings,
where ``config_paths`` may name only configs inside the installed nemo-gym and ``gym_overrides`` may only change
settings of the servers those configs define, never add a server or set an entrypoint, a path, a command, an
address or an interpolation.
Anything more comes from the user: ``--config`` (its grader settings replace the folder's) or ``key=value``.

The new folder is a run folder like any other (``run.json`` with ``rescore.source`` pointing at the source,
``results.jsonl``, the report and viewer), so ``gym-bridge compare SOURCE NEW`` shows what the grader change
did. A completion that cannot be re-verified keeps its stored reward, is marked ``"rescored": false`` with the
reason, and is listed in ``rescore.json``: listed, never dropped.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import httpx

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import write_atomic
from gym_bridge.boundary.json_io import dumps, loads
from gym_bridge.boundary.text import shown
from gym_bridge.eval.compare import GRADER_KEYS
from gym_bridge.eval.records import ROW_ID_KEY, row_id
from gym_bridge.eval.report import build_report
from gym_bridge.eval.rescore_trust import check_stored_overrides, trusted_config_files
from gym_bridge.eval.runs import (
    FAILURES_FILE,
    RUN_FILE,
    LoadedRun,
    ReadLimits,
    RunReadError,
    jsonl_lines,
    load_run,
    read_file,
)
from gym_bridge.eval.store import RunStore, not_empty, read_jsonl
from gym_bridge.failures import GymBridgeError
from gym_bridge.gym.protocol.row_file import MAX_ROW_DEPTH
from gym_bridge.gym.servers.log_folder import gym_log_dir
from gym_bridge.json_types import JsonMapping, JsonObject

logger = logging.getLogger(__name__)

RESCORE_FILE = "rescore.json"
_NOT_REQUEST_KEYS = {"reward", "token_drift", "mask_sample", "failure_kind"}


class RescoreError(GymBridgeError, ValueError):
    """A rescore cannot start: bad options, an output folder in use, or a config without the run's agents."""


class UnverifiedCompletion(TypedDict):
    """A completion the rescore could not verify; it keeps its stored reward (listed in ``rescore.json``)."""

    prompt_idx: int
    row_id: str
    agent: str
    completion: int
    reward: float
    reason: str


@dataclass
class RescoreOutcome:
    out_dir: Path
    completions: int
    changed: int
    unverified: list[UnverifiedCompletion] = field(default_factory=list)


def grader_config(source: LoadedRun, config_file: str | Path | None, overrides: list[str]) -> JsonObject:
    """The source run's config with the grader settings of ``config_file`` and the ``key=value`` overrides.

    Raises:
        RescoreError: an override names a key that is not a grader setting.
        EvalConfigError: ``config_file`` or an override value is invalid.
    """
    from gym_bridge.eval.config import load_config, parse_override

    config = copy.deepcopy(source.config)
    if config_file is not None:
        other = load_config(config_file, []).model_dump(mode="json")
        config.update({key: other[key] for key in GRADER_KEYS})
    for text in overrides:
        path, value = parse_override(text)
        if path[0] not in GRADER_KEYS:
            raise RescoreError(
                f"{text}: a rescore can change only the grader settings ({', '.join(GRADER_KEYS)}); "
                f"{path[0]} made the stored responses"
            )
        target = config
        for key in path[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise RescoreError(f"{text}: {key} is not a mapping")
        target[path[-1]] = value
    paths = config.get("config_paths")
    if not isinstance(paths, list) or not paths:
        raise RescoreError(
            f"{shown(source.dir / RUN_FILE)}: config.config_paths is missing or empty, so the Gym configs that grade "
            "this run are unknown; name them with config_paths=[...] or --config"
        )
    return config


def _config_blocks(config_paths: list[str] | list[Path], overrides: JsonObject) -> JsonObject:
    """Gym's server blocks from the config files, with the overrides merged (as Gym layers them).

    Raises:
        RescoreError: a config file cannot be read or is not a YAML mapping.
        GymConfigNotFound: a relative path is neither in the cwd nor in the installed nemo-gym.
    """
    from gym_bridge.gym.servers.config_files import GymConfigError, GymConfigNotFound, merged_blocks

    try:
        return merged_blocks(config_paths, overrides)
    except GymConfigNotFound:
        raise
    except GymConfigError as exc:
        raise RescoreError(f"config_paths: {exc}") from None


def agent_resources_servers(blocks: JsonMapping) -> dict[str, str]:
    """Agent name -> the resources server that verifies its rows (the agent block's ``resources_server``)."""
    mapping = {}
    for name, block in blocks.items():
        if isinstance(block, dict) and isinstance(block.get("responses_api_agents"), dict):
            for impl in block["responses_api_agents"].values():
                server = (impl or {}).get("resources_server") or {}
                if server.get("name"):
                    mapping[str(name)] = str(server["name"])
    return mapping


def _dataset_rows(source: LoadedRun) -> dict[str, JsonObject]:
    """The dataset's rows by identity, when the file is still there unchanged; else none (stored fields serve).

    The file is read as a run folder's files are (a regular file, under the size cap) and split on ``\\n`` only.
    """
    path = source.meta.config.dataset
    shown_path = shown(path)
    try:
        data = read_file(Path(path), ReadLimits.from_env().max_jsonl_bytes) if path else None
    except RunReadError as exc:
        logger.warning("%s: the verify requests are built from the stored Gym results", exc)
        return {}
    if data is None:
        logger.warning("the dataset %s is gone: the verify requests are built from the stored Gym results", shown_path)
        return {}
    if hashlib.sha256(data).hexdigest() != source.meta.fingerprint.dataset_sha256:
        logger.warning("the dataset %s changed since the run: the stored Gym results' fields are used", shown_path)
        return {}
    rows: dict[str, JsonObject] = {}
    lines, tail = jsonl_lines(data)
    for line in [*lines, tail]:
        if line.strip():
            try:
                row = loads(line, shown_path, max_depth=MAX_ROW_DEPTH)
            except UntrustedInputError:
                logger.warning("the dataset %s has a bad line: the stored Gym results' fields are used", shown_path)
                return {}
            if isinstance(row, dict):
                rows.setdefault(row_id(row), row)
    return rows


def verify_request(row: JsonMapping | None, gym_result: JsonMapping) -> JsonObject:
    """The ``/verify`` body for one stored completion: its row, with the stored request and response.

    Raises:
        KeyError: the stored Gym result has no ``response`` (nothing to verify).
    """
    response = gym_result["response"]
    base = row if row is not None else {k: v for k, v in gym_result.items() if k not in _NOT_REQUEST_KEYS}
    body = {**base, "response": response}
    if "responses_create_params" in gym_result:
        body["responses_create_params"] = gym_result["responses_create_params"]
    return body


def rescore_run(
    source_dir: str | Path,
    out_dir: str | Path,
    *,
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    concurrency: int = 16,
    startup_timeout_s: float = 180.0,
    request_timeout_s: float = 120.0,
) -> RescoreOutcome:
    """Verify every stored completion of ``source_dir`` again through real Gym servers; write ``out_dir``.

    Everything is checked before anything starts, the trust boundary included (:func:`trusted_config_files`,
    :func:`check_stored_overrides`): a folder that names code, a path or a command is refused, never run.

    Raises:
        RunReadError: the source run folder cannot be read (missing, being written, a malformed line or field),
            or its grader settings name more than data (the field named).
        RescoreError: bad overrides, an output folder that is not empty, or an agent without a resources server.
        GymStartupError: Gym's servers did not start.
    """
    from gym_bridge.gym.servers.server_config import GymServersConfig, deep_merge
    from gym_bridge.gym.servers.server_set import GymServers

    source = load_run(source_dir, failures=True)
    out = Path(out_dir)
    if not_empty(out):
        raise RescoreError(f"the output folder {shown(out)} is not empty; choose another --out")
    overrides = overrides or []
    config = grader_config(source, config_file, overrides)
    run_json = source.dir / RUN_FILE
    paths_from_run = config_file is None and not any(o.partition("=")[0].strip() == "config_paths" for o in overrides)
    files = trusted_config_files(list(config["config_paths"]), run_json if paths_from_run else None)
    base = _config_blocks(files, {})
    if config_file is None:
        check_stored_overrides(source.config.get("gym_overrides") or {}, base, run_json)
    blocks = deep_merge(base, dict(config.get("gym_overrides") or {}))
    servers_of = agent_resources_servers(blocks)
    missing = sorted({g.agent for g in source.groups} - set(servers_of))
    if missing:
        raise RescoreError(f"config_paths {config['config_paths']} have no agent block for {', '.join(missing)}")
    rows = _dataset_rows(source)
    started = time.time()
    fingerprint = {**source.fingerprint, **{k: config.get(k) for k in ("config_paths", "gym_overrides")}}
    store = RunStore(out)
    store.open(fingerprint, resume=False)  # holds run.lock until written: compare refuses a rescore in progress
    servers = GymServers(
        GymServersConfig(
            config_paths=[str(path) for path in files],
            overrides=dict(config.get("gym_overrides") or {}),
            policy_base_urls=["http://127.0.0.1:9/v1"],  # nothing generates: no model is called
            policy_model_name="none",
            use_ray=False,
            startup_timeout_s=startup_timeout_s,
            log_dir=gym_log_dir(out),  # made by this run in its new folder: no link of anyone's
        )
    )
    try:
        servers.start()
        try:
            verdicts = asyncio.run(
                _verify_all(source, rows, servers.server_urls, servers_of, concurrency, request_timeout_s)
            )
        finally:
            servers.stop()
        return _write(source, store, config, verdicts, started)
    finally:
        store.close()


async def _verify_all(
    source: LoadedRun,
    rows: dict[str, JsonObject],
    urls: dict[str, str],
    servers_of: dict[str, str],
    concurrency: int,
    timeout_s: float,
) -> dict[tuple[int, int], JsonObject]:
    """(group, completion) -> Gym's verify response, or ``{"error": reason}``."""
    limit = asyncio.Semaphore(concurrency)
    results: dict[tuple[int, int], JsonObject] = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        modes = {}
        for name in sorted(set(servers_of.values())):
            try:
                answer = await client.get(f"{urls[name]}/reverify_mode")
                modes[name] = answer.json() if answer.status_code == 200 else "unknown"
            except (httpx.HTTPError, ValueError, KeyError):
                modes[name] = "unknown"
        for name, mode in modes.items():
            if mode != "stateless":
                logger.warning("resources server %s reports reverify_mode=%s: its rewards may differ", name, mode)

        async def one(g: int, k: int) -> None:
            group = source.groups[g]
            server = servers_of[group.agent]
            gym_result = group.result.completions[k].gym_result or {}
            if modes.get(server) == "unsupported":
                results[g, k] = {"error": f"{server} says its verify cannot be repeated (reverify_mode unsupported)"}
                return
            try:
                body = verify_request(rows.get(group.key.split("#")[0]), gym_result)
            except (KeyError, TypeError):
                results[g, k] = {"error": "the stored Gym result has no response to verify"}
                return
            async with limit:
                try:
                    answer = await client.post(f"{urls[server]}/verify", json=body)
                except httpx.HTTPError as exc:
                    results[g, k] = {"error": f"POST {server}/verify failed: {type(exc).__name__}: {exc}"}
                    return
            if answer.status_code != 200:
                results[g, k] = {"error": f"POST {server}/verify answered {answer.status_code}: {answer.text[:300]}"}
                return
            verdict = answer.json()
            if not isinstance(verdict, dict) or not isinstance(verdict.get("reward"), int | float):
                results[g, k] = {"error": f"POST {server}/verify answered without a numeric reward"}
                return
            results[g, k] = verdict

        await asyncio.gather(
            *(one(g, k) for g, group in enumerate(source.groups) for k in range(len(group.record["completions"])))
        )
    return results


def _write(
    source: LoadedRun,
    store: RunStore,
    config: JsonObject,
    verdicts: dict[tuple[int, int], JsonObject],
    started: float,
) -> RescoreOutcome:
    """The new run folder's results, failures, ``run.json``, ``rescore.json`` and report."""
    out = store.dir
    unverified: list[UnverifiedCompletion] = []
    changed = total = 0
    try:
        for g, group in enumerate(source.groups):
            record = {**group.record, "completions": [dict(c) for c in group.record["completions"]]}
            for k, completion in enumerate(record["completions"]):
                total += 1
                verdict = verdicts[g, k]
                completion["previous_reward"] = completion["reward"]
                if "error" in verdict:
                    completion["rescored"] = False
                    completion["rescore_error"] = verdict["error"]
                    unverified.append(
                        {
                            "prompt_idx": group.prompt_idx,
                            ROW_ID_KEY: group.key,
                            "agent": group.agent,
                            "completion": k,
                            "reward": completion["reward"],
                            "reason": verdict["error"],
                        }
                    )
                    continue
                completion["rescored"] = True
                completion["reward"] = float(verdict["reward"])
                if completion["reward"] != completion["previous_reward"]:
                    changed += 1
                completion["gym_result"] = {
                    **verdict,
                    **{
                        key: completion["gym_result"][key]
                        for key in ("token_drift",)
                        if key in completion["gym_result"]
                    },
                }
            store.append_result(record)
        for failure in read_jsonl(source.dir / FAILURES_FILE):
            store.append_failure(failure)
    finally:
        store.close()
    summary = {
        "source": str(source.dir.resolve()),
        "grader": {k: config.get(k) for k in GRADER_KEYS},
        "source_grader": {k: source.fingerprint.get(k, source.config.get(k)) for k in GRADER_KEYS[:2]}
        | {"pass_threshold": source.pass_threshold},
        "completions": total,
        "rescored": total - len(unverified),
        "changed": changed,
        "unverified": unverified,
    }
    store.update_run(
        config=config,
        prompts_total=source.meta.prompts_total,
        model=source.meta.model,
        rescore={"source": summary["source"], "changed": changed, "unverified": len(unverified)},
    )
    store.record_session(started, outcome="rescored")
    write_atomic(out / RESCORE_FILE, dumps(summary, indent=True) + b"\n", root=out)
    build_report(out)
    return RescoreOutcome(out_dir=out, completions=total, changed=changed, unverified=unverified)
