"""Session affinity in gym-bridge's Gym model server: every model call of one rollout carries the rollout's session
key in ``X-Session-ID`` (Gym #2570's proposal) and goes to one replica of ``base_url`` while it is healthy; a failed
replica's sessions move to the other.

Real components: two fault-gate proxy processes (``gym_bridge/testing/fault_gate.py``) in front of our scripted
server stand for two replicas and record the header of every completions call they forward; the model server
renders each turn with the tiny tokenizer and calls them as it calls vLLM. No Gym servers are needed.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym_model.app import GymModelServer
from gym_bridge.gym_model.config import GymModelConfig
from gym_bridge.testing import SERVED_MODEL_NAME
from gym_bridge.testing.fault_gate import FaultGate
from gym_bridge.testing.gym_rows import equivalence_row

SESSIONS = 8
CALLS = 3


@pytest.fixture
def replicas(scripted_policy, tmp_path: Path) -> Iterator[list[FaultGate]]:
    gates = [FaultGate(scripted_policy.root_url, free_port("127.0.0.1"), tmp_path / f"gate{i}.log") for i in range(2)]
    try:
        for gate in gates:
            gate.start()
        yield gates
    finally:
        for gate in gates:
            gate.kill()


def body(i: int) -> dict:
    return json.loads(json.dumps(equivalence_row(f"Reply with exactly: {i}", str(i))["responses_create_params"]))


async def test_every_call_of_a_session_reaches_one_replica_carrying_its_key(replicas, tiny_tokenizer) -> None:
    config = GymModelConfig(port=0, base_url=[g.base_url for g in replicas], model=SERVED_MODEL_NAME)
    server = GymModelServer(config, tiny_tokenizer)
    await server.start()
    try:
        for call in range(CALLS):
            for s in range(SESSIONS):
                await server.responses(body(call), f"rollout-{s}")
        seen = [collections.Counter(gate.stats()["sessions"]) for gate in replicas]
        assert all(seen), f"both replicas serve sessions: {seen}"
        assert not set(seen[0]) & set(seen[1]), f"no session is split between replicas: {seen}"
        assert seen[0] + seen[1] == {f"rollout-{s}": CALLS for s in range(SESSIONS)}, "every call carries its key"

        moved = next(iter(seen[0]))
        replicas[0].kill()  # the replica holding ``moved`` fails: its session goes on at the other
        await server.responses(body(9), moved)
        assert replicas[1].stats()["sessions"][-1] == moved
    finally:
        await server.client.close()


async def test_no_header_is_sent_when_it_is_switched_off(replicas, tiny_tokenizer) -> None:
    config = GymModelConfig(
        port=0, base_url=[replicas[0].base_url], model=SERVED_MODEL_NAME, session_affinity_header=None
    )
    server = GymModelServer(config, tiny_tokenizer)
    await server.start()
    try:
        await server.responses(body(0), "rollout-0")
    finally:
        await server.client.close()
    assert replicas[0].stats()["sessions"] == [None]


async def test_without_affinity_a_sessions_calls_go_to_the_least_loaded_replica(replicas, tiny_tokenizer) -> None:
    """``session_affinity: false`` (what the benchmark compares against): calls made one after another alternate
    between the idle replicas, so a session's turns are split; each still carries its key."""
    urls = [g.base_url for g in replicas]
    config = GymModelConfig(port=0, base_url=urls, model=SERVED_MODEL_NAME, session_affinity=False)
    server = GymModelServer(config, tiny_tokenizer)
    await server.start()
    try:
        for call in range(CALLS + 1):
            await server.responses(body(call), "rollout-0")
    finally:
        await server.client.close()
    seen = [gate.stats()["sessions"] for gate in replicas]
    assert seen[0] == seen[1] == ["rollout-0"] * ((CALLS + 1) // 2), f"split evenly, key on every call: {seen}"


@pytest.mark.parametrize("name", ["", "X Session", "X-Session-ID\r\nEvil: 1", "x" * 65])
def test_a_header_name_that_is_not_a_token_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="session_affinity_header"):
        GymModelConfig(port=0, base_url=["http://127.0.0.1:9/v1"], model="m", session_affinity_header=name)
