"""A restarted Gym server as its parent sees it: running again and answering, being started again, or past its last
allowed restart. The launcher does the restarting (:func:`gym_bridge.gym.servers._launcher.keep_servers_up`) and
records each server's ``restarts``, ``exit_code`` and ``gave_up`` in its status file; this reads one entry."""

from __future__ import annotations

from pathlib import Path

from gym_bridge.failures import GymServerCrashLoop, GymServerRestarting
from gym_bridge.gym.servers.reaper import answers
from gym_bridge.json_types import JsonObject


def restart_seen(name: str, entry: JsonObject, alive: bool, seen: int, max_restarts: int, log: Path) -> int:
    """The restarts of server ``name`` that answer again: ``seen`` (the count already taken in) when nothing changed,
    the status file's count once the restarted server answers.

    Raises:
        GymServerRestarting: the server exited and is being started again, or is not answering since.
        GymServerCrashLoop: the server exited after its last allowed restart.
    """
    count = int(entry.get("restarts", 0))
    if count == seen and alive:
        return seen
    code = entry.get("exit_code")
    if entry.get("gave_up") or (not alive and count >= max_restarts):
        raise GymServerCrashLoop(
            f"NeMo-Gym server {name!r} exited (code {code}) after its last allowed restart "
            f"({count} of {max_restarts}); its log: {log}; the run stops here (--resume continues it)"
        )
    if alive and answers(str(entry["host"]), int(entry["port"])):
        return count
    raise GymServerRestarting(
        f"NeMo-Gym server {name!r} exited (code {code}); restart {max(count, 1)} of {max_restarts} under way; "
        f"its log: {log}"
    )
