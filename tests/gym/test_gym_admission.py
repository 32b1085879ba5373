"""The rules of adaptive admission (gym/transport/admission.py), the endpoint-load reader (gym/transport/endpoint_load.py) and the
counters they leave in RolloutStats: halving once per saturation, growing by one per success, pauses that double,
arrival order, the in-flight deadline, and vLLM's request gauges read from a real HTTP server."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from gym_bridge.failures import RolloutStats, RolloutTimeout, SettingError
from gym_bridge.gym.transport.admission import (
    AdmissionControl,
    AdmissionSettings,
    EndpointLoad,
    InFlightDeadline,
    SaturationReason,
    saturation_reason,
)
from gym_bridge.gym.transport.endpoint_load import metrics_url, parse_request_gauges, read_endpoint_load


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def control(**settings: object) -> tuple[AdmissionControl, Clock]:
    clock = Clock()
    return AdmissionControl(AdmissionSettings(**settings), clock=clock), clock  # type: ignore[arg-type]


async def admit_groups(admission: AdmissionControl, groups: int, rows: int = 2) -> list:
    return [await admission.acquire(rows) for _ in range(groups)]


def test_a_saturation_halves_the_rows_in_flight_once_per_epoch():
    async def scenario() -> None:
        admission, _ = control(backoff_base_s=1.0)
        tickets = await admit_groups(admission, 5)
        assert admission.in_flight == 10 and admission.limit is None
        assert admission.back_off(tickets[0]) == 1.0
        assert admission.limit == 5 and admission.backoffs == 1
        # The other groups sent in the same wave time out too: the limit is not halved again for them.
        assert [admission.back_off(t) for t in tickets[1:]] == [None] * 4
        assert admission.limit == 5 and admission.backoffs == 1

    asyncio.run(scenario())


def test_halvings_stop_at_the_floor_and_the_pause_doubles_until_a_success():
    async def scenario() -> None:
        admission, clock = control(backoff_base_s=1.0, max_backoff_s=3.0, min_limit=1)
        pauses, limits = [], []
        for _ in range(4):
            ticket = await admission.acquire(4)
            pauses.append(admission.back_off(ticket))
            limits.append(admission.limit)
            admission.release(ticket)
            clock.now += 10  # past the pause
        assert limits == [2, 1, 1, 1]
        assert pauses == [1.0, 2.0, 3.0, 3.0]
        ticket = await admission.acquire(1)
        admission.row_done(ticket, success=True)
        ticket = await admission.acquire(1)
        assert admission.back_off(ticket) == 1.0, "a success ends the streak of back-offs"
        assert admission.backoff_s == 10.0

    asyncio.run(scenario())


def test_each_success_grows_the_limit_by_one_until_it_is_lifted_at_the_peak():
    async def scenario() -> None:
        admission, clock = control()
        tickets = await admit_groups(admission, 4)  # 8 rows in flight: the peak
        admission.back_off(tickets[0])
        assert admission.limit == 4
        clock.now += 100
        limits = []
        for ticket in tickets[:2]:
            for _ in range(2):
                admission.row_done(ticket, success=True)
                limits.append(admission.limit)
        assert limits == [5, 6, 7, None]
        assert admission.lowest_limit == 4

    asyncio.run(scenario())


def test_a_failed_row_frees_its_place_without_growing_the_limit():
    async def scenario() -> None:
        admission, clock = control()
        tickets = await admit_groups(admission, 3)
        admission.back_off(tickets[0])
        clock.now += 100
        admission.row_done(tickets[1], success=False)
        assert admission.limit == 3 and admission.in_flight == 5

    asyncio.run(scenario())


def test_a_set_initial_limit_caps_the_growth():
    async def scenario() -> None:
        admission, clock = control(initial_limit=4)
        first = await admission.acquire(4)
        admission.back_off(first)
        clock.now += 100
        admission.release(first)
        ticket = await admission.acquire(2)
        for _ in range(2):
            admission.row_done(ticket, success=True)
        again = await admission.acquire(4)
        for _ in range(4):
            admission.row_done(again, success=True)
        assert admission.limit == 4

    asyncio.run(scenario())


def test_groups_wait_in_arrival_order_and_a_group_larger_than_the_limit_goes_alone():
    async def scenario() -> None:
        admission, _ = control(initial_limit=3)
        first = await admission.acquire(2)
        big = asyncio.create_task(admission.acquire(5))
        small = asyncio.create_task(admission.acquire(1))
        await asyncio.sleep(0)
        assert not big.done() and not small.done(), "the one-row group fits but waits behind the earlier group"
        admission.release(first)
        big_ticket = await asyncio.wait_for(big, 5)
        assert admission.in_flight == 5 and not small.done()
        admission.release(big_ticket)
        await asyncio.wait_for(small, 5)
        assert admission.in_flight == 1

    asyncio.run(scenario())


def test_after_a_back_off_admission_pauses_then_resumes():
    async def scenario() -> None:
        admission = AdmissionControl(AdmissionSettings(backoff_base_s=0.2))
        ticket = await admission.acquire(2)
        admission.back_off(ticket)
        admission.release(ticket)
        assert admission.in_flight == 0 and not admission.fits(1)
        waiting = asyncio.create_task(admission.acquire(1))
        await asyncio.sleep(0)
        assert not waiting.done(), "nothing is admitted during the pause"
        await asyncio.wait_for(waiting, 10)
        assert admission.in_flight == 1

    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_nothing_counted():
    async def scenario() -> None:
        admission, _ = control(initial_limit=2)
        first = await admission.acquire(2)
        waiting = asyncio.create_task(admission.acquire(2))
        later = asyncio.create_task(admission.acquire(2))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        admission.release(first)
        await asyncio.wait_for(later, 5)
        assert admission.in_flight == 2 and admission.waiting_rows == 0

    asyncio.run(scenario())


def test_without_adaptation_every_row_goes_at_once_and_nothing_backs_off():
    async def scenario() -> None:
        admission, _ = control(adaptive=False, initial_limit=2)
        tickets = await admit_groups(admission, 5)
        assert admission.in_flight == 10
        assert admission.back_off(tickets[0]) is None
        assert admission.fits(100) and admission.backoffs == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("load", "fastest", "elapsed", "in_flight", "expected"),
    [
        (EndpointLoad(reachable=False), None, 30.0, 10, None),
        (EndpointLoad(reachable=True, waiting=3.0, running=4.0), 100.0, 30.0, 1, SaturationReason.ENDPOINT_QUEUE),
        (EndpointLoad(reachable=True, waiting=0.0, running=8.0), 10.0, 30.0, 8, SaturationReason.LATENCY),
        (EndpointLoad(reachable=True), 20.0, 30.0, 8, None),
        (None, 10.0, 20.0, 1, SaturationReason.LATENCY),
        (None, None, 30.0, 10, SaturationReason.LATENCY),
        (None, None, 30.0, 1, None),
    ],
    ids=["endpoint-down", "queue", "latency-rose", "deadline-too-tight", "latency-alone", "nothing-finished", "alone"],
)
def test_which_timeouts_count_as_a_saturated_engine(load, fastest, elapsed, in_flight, expected):
    assert saturation_reason(load, fastest, elapsed, in_flight, 2.0) is expected


def test_settings_are_checked():
    for bad in ({"initial_limit": 0}, {"min_limit": 0}, {"backoff_base_s": -1.0}, {"latency_rise": 0.5}):
        with pytest.raises(SettingError):
            AdmissionSettings(**bad)  # type: ignore[arg-type]


def test_the_in_flight_deadline_counts_only_the_time_running():
    async def scenario() -> None:
        clock = InFlightDeadline(1.0, "NeMo-Gym prompt group")
        for _ in range(3):
            async with clock.running():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # waiting for admission: not on the clock
        assert not clock.expired and clock.used_s < 1.0
        with pytest.raises(RolloutTimeout, match=r"NeMo-Gym prompt group exceeded 1\.0s"):
            async with clock.running():
                await asyncio.sleep(30)
        assert clock.expired
        with pytest.raises(RolloutTimeout):
            async with clock.running():
                pass

    asyncio.run(scenario())


def test_a_timeout_error_of_the_body_is_not_the_deadline():
    async def scenario() -> None:
        clock = InFlightDeadline(30.0, "group")
        with pytest.raises(TimeoutError) as info:
            async with clock.running():
                raise TimeoutError("the body's own")
        assert not isinstance(info.value, RolloutTimeout) and not clock.expired

    asyncio.run(scenario())


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
"""


def test_vllm_request_gauges_are_summed_over_their_label_sets():
    assert parse_request_gauges(VLLM_METRICS) == (3.0, 3.0)
    assert parse_request_gauges("vllm:num_requests_waiting 0\n") == (0.0, None)
    assert parse_request_gauges("gym_bridge_drift_total 4\n") == (None, None)
    assert metrics_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/metrics"


def test_endpoint_load_is_read_from_real_metrics_endpoints():
    async def scenario() -> tuple[EndpointLoad, EndpointLoad, EndpointLoad]:
        async def vllm(_: web.Request) -> web.Response:
            return web.Response(text=VLLM_METRICS)

        async def plain(_: web.Request) -> web.Response:
            return web.Response(text="gym_bridge_requests_total 4\n")

        runners, urls = [], []
        for handler in (vllm, plain):
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            sock = socket.create_server(("127.0.0.1", 0))
            urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}/v1")
            await web.SockSite(runner, sock).start()
            runners.append(runner)
        closed = socket.create_server(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
        closed.close()
        try:
            both = await read_endpoint_load(urls, 5.0)
            plain_only = await read_endpoint_load([urls[1], dead], 5.0)
            down = await read_endpoint_load([dead], 5.0)
        finally:
            for runner in runners:
                await runner.cleanup()
        return both, plain_only, down

    both, plain_only, down = asyncio.run(scenario())
    assert both == EndpointLoad(reachable=True, waiting=3.0, running=3.0)
    assert plain_only == EndpointLoad(reachable=True, waiting=None, running=None)
    assert down == EndpointLoad(reachable=False)


def test_stats_name_what_admission_did():
    stats = RolloutStats()
    assert "rollout/admission_limit" not in stats.as_metrics()
    stats.record_saturation_timeout("latency", 1.0)
    stats.record_saturation_timeout("latency", None)
    stats.record_saturation_timeout("endpoint_queue", 2.0)
    stats.record_admission_limit(5)
    stats.record_admission_limit(2)
    stats.record_admission_limit(3)
    metrics = stats.as_metrics()
    assert metrics["rollout/saturation_timeout_total"] == 3.0
    assert metrics["rollout/saturation_timeout_total/latency"] == 2.0
    assert metrics["rollout/saturation_timeout_total/endpoint_queue"] == 1.0
    assert metrics["rollout/admission_backoff_total"] == 2.0
    assert metrics["rollout/admission_backoff_s"] == 3.0
    assert metrics["rollout/admission_limit"] == 3.0
    assert metrics["rollout/admission_lowest_limit"] == 2.0
    stats.record_admission_limit(None)
    assert "rollout/admission_limit" not in stats.as_metrics()
    assert stats.as_metrics()["rollout/admission_lowest_limit"] == 2.0
