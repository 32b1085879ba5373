"""What keeps 16,384 rows in flight cheap: one health watch per actor, one agent question per client,
and an actor that admits every group at once. Unit tests of single functions; no Ray, no Gym."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from gym_bridge.failures import GymTransportError
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.transport.actor import NemoGym
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.gym.transport.health import SharedWatch
from gym_bridge.gym.transport.spinup import DEFAULT_MAX_CONCURRENCY, actor_options


def _config(**update: Any) -> NemoGymConfig:
    return NemoGymConfig(model_name="tiny", base_urls=["http://127.0.0.1:9/v1"], health_poll_s=3600, **update)


def _watch() -> SharedWatch[object]:
    async def poll_forever(_target: object) -> None:
        await asyncio.Event().wait()

    return SharedWatch(poll_forever, "test-watch")


def test_streams_in_flight_share_one_health_watch_and_the_last_one_out_stops_it():
    async def scenario() -> None:
        shared, servers = _watch(), object()
        callbacks = [lambda _t, i=i: None for i in range(3)]
        watches = [shared.join(servers) for _ in callbacks]
        assert watches[0] is watches[1] is watches[2]
        assert shared.members == {watches[0]: 3}
        for watch, callback in zip(watches[:2], callbacks[:2], strict=True):
            shared.leave(watch, callback)
        assert not watches[0].cancelled() and shared.members == {watches[0]: 1}
        shared.leave(watches[2], callbacks[2])
        await asyncio.sleep(0)
        assert watches[0].cancelled()
        assert shared.members == {} and shared.current is None

    asyncio.run(scenario())


def test_new_servers_get_a_new_watch_and_the_old_one_stops_with_its_last_stream():
    async def scenario() -> None:
        shared = _watch()
        old = shared.join(object())
        new = shared.join(object())  # after a re-spin: the old watch polls servers that are gone
        assert old is not new and shared.members == {old: 1, new: 1}
        shared.leave(old, lambda _t: None)
        await asyncio.sleep(0)
        assert old.cancelled() and not new.cancelled() and shared.current is new
        shared.leave(new, lambda _t: None)
        await asyncio.sleep(0)
        assert new.cancelled() and shared.members == {}

    asyncio.run(scenario())


def test_a_failed_watch_is_replaced_for_the_next_stream():
    async def scenario() -> None:
        shared, servers = _watch(), object()
        failed = shared.join(servers)
        failed.cancel()
        await asyncio.sleep(0)
        fresh = shared.join(servers)
        assert fresh is not failed and not fresh.done()
        shared.leave(failed, lambda _t: None)
        shared.leave(fresh, lambda _t: None)
        assert shared.members == {}

    asyncio.run(scenario())


class _Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1

        async def reply() -> Any:
            await asyncio.sleep(0.01)
            return self.answer

        return reply()


class _Actor:
    def __init__(self) -> None:
        self.routes = _Method(GymRoutes(agents=("a", "b")))


def test_groups_launched_together_ask_the_actor_for_its_agents_once():
    actor = _Actor()
    client = GymClient([actor])

    async def scenario() -> list[list[str] | None]:
        return await asyncio.gather(*(client.agent_names() for _ in range(64)))

    answers = asyncio.run(scenario())
    assert actor.routes.calls == 1
    assert answers == [["a", "b"]] * 64


def test_actor_admits_every_group_at_once_unless_the_config_says_otherwise():
    assert actor_options(_config())["max_concurrency"] == DEFAULT_MAX_CONCURRENCY > 16384
    assert actor_options(_config(actor_options={"num_cpus": 0})) == {
        "max_concurrency": DEFAULT_MAX_CONCURRENCY,
        "num_cpus": 0,
    }
    assert actor_options(_config(actor_options={"max_concurrency": 8}))["max_concurrency"] == 8


def test_rows_waiting_for_a_pooled_connection_are_not_failed_by_the_connect_timeout():
    """More rows than ``max_connections``: a row waits in the pool longer than ``connect_timeout_s``
    (aiohttp's ``connect`` would fail it with ConnectionTimeoutError); only the TCP connect is bounded."""
    from aiohttp import web

    async def scenario() -> list[int]:
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(0.15)
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/run", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        actor = NemoGym(_config(max_connections=1, connect_timeout_s=0.1))
        try:
            client = actor._http_client()

            async def post() -> int:
                async with client.post(f"http://127.0.0.1:{port}/run", json={}) as response:
                    await response.read()
                    return response.status

            return await asyncio.wait_for(asyncio.gather(*(post() for _ in range(4))), 10)
        finally:
            await actor.shutdown()
            await runner.cleanup()

    assert asyncio.run(scenario()) == [200] * 4


class _EmptyStream:
    def __aiter__(self) -> _EmptyStream:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration


class _StreamingActor:
    """Records the loop iteration in which each ``run_row_batches`` stream was submitted."""

    def __init__(self, clock: list[int]) -> None:
        self.clock = clock
        self.submitted_at: list[int] = []
        self.run_row_batches = self

    def options(self, **_: Any) -> _StreamingActor:
        return self

    def remote(self, rows: Any, prefix: str) -> _EmptyStream:
        self.submitted_at.append(self.clock[0])
        return _EmptyStream()


def test_groups_launched_together_submit_their_streams_one_loop_iteration_apart():
    """1,024 groups submitting in one iteration would hold the driver's loop ~0.5 s (benchmarks/RESULTS.md)."""
    clock = [0]
    actor = _StreamingActor(clock)
    client = GymClient([actor], max_gym_row_attempts=1)

    async def iterations() -> None:
        while True:
            clock[0] += 1
            await asyncio.sleep(0)

    async def scenario() -> list[object]:
        ticker = asyncio.create_task(iterations())
        groups = [client.run_group([{"_rowidx": 0}], prompt_idx=g, deadline_s=None) for g in range(16)]
        outcomes = await asyncio.gather(*groups, return_exceptions=True)
        ticker.cancel()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert len(actor.submitted_at) == 16
    assert len(set(actor.submitted_at)) == 16, actor.submitted_at
    assert client.in_flight_rows == [0]
    # The stand-in streams no rows, so each group ends with its row missing, and nothing else goes wrong.
    assert all(isinstance(o, GymTransportError) and "missing rows [0]" in str(o) for o in outcomes), outcomes
