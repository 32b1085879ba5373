"""Raw NeMo-Gym rollout collection in a process of its own, driven by ``bridge_throughput.py``.

Why a separate process: Gym keeps its global config and its aiohttp session
process-wide (the session is bound to the first event loop that uses it), and
importing its rollout code patches ``builtins.print`` and adds about 200 MB,
which would distort the driver's memory and event-loop numbers. The worker
takes the head server's config the way a Gym server child does (through
``NEMO_GYM_CONFIG_DICT``), so ``run_examples`` needs nothing but the head address.

Protocol, one JSON object per line: the driver writes ``{"rows": [...]}`` on
stdin; the worker runs ``RolloutCollectionHelper().run_examples`` with every row
in flight at once and answers ``{"wall_s", "ok", "errors", "mean_reward",
"first_error"}`` on the file descriptor that was its stdout (Gym's own prints go
to stderr). An empty line or EOF ends it. The driver bounds every answer.

Run: ``python benchmarks/raw_gym_worker.py http://127.0.0.1:<head port>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from typing import IO, Any
from urllib.parse import urlsplit


async def _run(rows: list[dict[str, Any]], rch: Any, head: Any) -> dict[str, Any]:
    ok = errors = 0
    rewards: list[float] = []
    first_error: str | None = None
    started = time.perf_counter()
    for future in rch.run_examples(examples=rows, head_server_config=head):
        try:
            _, result = await future
        except Exception as exc:  # noqa: BLE001 - counted and reported to the driver
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
            continue
        ok += 1
        rewards.append(float(result.get("reward", 0.0)))
    return {
        "wall_s": time.perf_counter() - started,
        "ok": ok,
        "errors": errors,
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "first_error": first_error,
    }


async def _serve(head_url: str, answers: IO[str]) -> None:
    from nemo_gym.rollout_collection import RolloutCollectionHelper
    from nemo_gym.server_utils import BaseServerConfig

    parts = urlsplit(head_url)
    head = BaseServerConfig(host=parts.hostname, port=parts.port)
    rch = RolloutCollectionHelper()
    loop = asyncio.get_running_loop()
    answers.write(json.dumps({"ready": True}) + "\n")
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            return
        answer = await _run(json.loads(line)["rows"], rch, head)
        answers.write(json.dumps(answer) + "\n")


def main() -> None:
    head_url = sys.argv[1].rstrip("/")
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    with urllib.request.urlopen(f"{head_url}/global_config_dict_yaml", timeout=30) as response:
        os.environ["NEMO_GYM_CONFIG_DICT"] = json.loads(response.read())  # a JSON string holding the YAML
    asyncio.run(_serve(head_url, answers))


if __name__ == "__main__":
    main()
