"""Fault injection with real components: our server (scripted policy) behind a fault-injecting
proxy process, real Gym servers (model + equivalence agent), the real NemoGym actor on real Ray,
and ``RolloutManager.collect`` with a retry policy and an in-memory sink.

Each test states the fault, the expected typed outcome and a time bound, and checks that
nothing is lost or duplicated: every prompt is either committed once with all N rows, or
counted as skipped; no slot is left reserved. docs/reliability.md tabulates these cases.
The tests run in file order: the last two break the module's Gym on purpose.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import ray

from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import (
    EndpointConfigError,
    EndpointUnavailable,
    GymServerCrashLoop,
    GymRowIndexError,
    GymTransportError,
    MissingGenerationData,
    NemoGymUnavailable,
    RolloutRedispatchExhausted,
    RolloutTimeout,
    RunConfigurationError,
)
from gym_bridge.gym.protocol.result import GymRowBatch
from gym_bridge.gym.protocol.rows import InvalidGymRow
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor
from gym_bridge.gym_versions import installed_gym
from gym_bridge.rollout.manager import RolloutManager, RolloutOutcome
from gym_bridge.rollout.sink import InMemorySink
from gym_bridge.testing import async_wait_until
from gym_bridge.testing.fault_gate import FaultGate
from gym_bridge.testing.gym_rows import (
    EQUIVALENCE_GYM_CONFIGS,
    N,
    equivalence_row,
    gym_actor_config,
    make_manager,
    prompt,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.gym, pytest.mark.slow]

MARGIN_S = 5.0  # allowed past a deadline: backoff, Ray round trips, a loaded 2-core machine
PLANTED_API_KEY = "sk-planted-7f3c9e1d2b"  # Gym's policy_api_key here; must never reach a log or result
CONTEXT_LENGTH_400 = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "in the messages, Please reduce the length of the messages."
)



@pytest.fixture(scope="module")
def gate(scripted_policy, tmp_path_factory):
    gate = FaultGate(scripted_policy.root_url, free_port("127.0.0.1"), tmp_path_factory.mktemp("gate") / "gate.log")
    gate.start()
    yield gate
    gate.kill()


@pytest.fixture(autouse=True)
def healthy_gate(gate):
    """Every test starts and ends with the gate up and passing requests through."""
    if gate.proc is None:
        gate.start()
    gate.set("pass")
    yield
    if gate.proc is None:
        gate.start()
    gate.set("pass")


@pytest.fixture(scope="module")
def fault_gym(ray_session, gate, tiny_tokenizer, tmp_path_factory):
    """A NemoGym actor of its own (3 Gym servers) whose endpoint is the gate; Ray may restart it once."""
    config = gym_actor_config([gate.base_url], tmp_path_factory.mktemp("fault-gym-logs")).model_copy(
        update={
            "config_paths": [str(wheel_config_path(p)) for p in EQUIVALENCE_GYM_CONFIGS],
            "request_timeout_s": 30.0,
            "health_poll_s": 0.5,
            "on_restart": "respin",
            "api_key": PLANTED_API_KEY,
            "actor_options": {"num_cpus": 0, "max_restarts": 1},
        }
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    try:
        ray.get(actor.shutdown.remote(), timeout=120)
    except ray.exceptions.RayError as exc:  # a test failed while Ray was restarting it
        print(f"fault_gym shutdown: {type(exc).__name__}: {exc}")
    finally:
        ray.kill(actor)


async def rows_in_flight(gate: FaultGate, seen: int, timeout_s: float = 30.0) -> None:
    """Wait until Gym's requests reach the (delaying) gate: rows are in flight, not merely submitted."""
    await async_wait_until(
        lambda: asyncio.to_thread(lambda: gate.stats()["chat"] > seen), timeout_s, "a chat request at the gate"
    )


async def collect(manager: RolloutManager, prompts: list[dict]) -> tuple[list[RolloutOutcome], InMemorySink, float]:
    """``collect`` every prompt concurrently; check the sink invariants; return outcomes, sink, seconds."""
    sink = InMemorySink()
    t0 = time.monotonic()
    outcomes = await asyncio.gather(*(manager.collect(p, sink) for p in prompts))
    elapsed = time.monotonic() - t0
    assert not sink.reserved, f"slots left reserved: {sink.reserved}"
    committed = [p["idx"] for p, o in zip(prompts, outcomes, strict=True) if o is RolloutOutcome.COMMITTED]
    assert sorted(r.prompt_idx for r in sink.records) == sorted(committed), "a committed prompt is missing or doubled"
    for record in sink.records:
        assert len(record.completions) == N
        assert all(c.reward == 1.0 for c in record.completions), "the scripted policy answers every prompt right"
        assert all(any(m["role"] == "assistant" and m["token_ids"].numel() for m in c.message_log)
                   for c in record.completions)
    return outcomes, sink, elapsed


def counts(manager: RolloutManager) -> dict[str, float]:
    """The manager's non-zero ``rollout/*`` counters."""
    return {key: value for key, value in manager.stats.as_metrics().items() if value}


# ---- malformed rows: rejected before anything is sent ----------------------------------------


BAD_ROWS = [
    ("no responses_create_params", lambda r: r.pop("responses_create_params"), "responses_create_params: Field required"),
    ("no agent_ref", lambda r: r.pop("agent_ref"), "agent_ref: Field required"),
    ("input of the wrong type", lambda r: r["responses_create_params"].update(input=123), "responses_create_params.input"),
    ("unknown agent", lambda r: r["agent_ref"].update(name="nope"), "'nope' is not a running agent"),
    ("a key Gym rejects with 422", lambda r: r["responses_create_params"].update(bogus=1), "unknown key(s) ['bogus']"),
    ("agent name not a string", lambda r: r["agent_ref"].update(name=7), "agent_ref.name"),
]


async def test_malformed_rows_are_rejected_before_dispatch(fault_gym, gate, tiny_tokenizer):
    """Fault: each kind of malformed row. Expected: InvalidGymRow naming prompt and field, no request
    sent, < 1 s; with collect, every one SKIPPED and counted as a data failure."""
    manager = make_manager(fault_gym, tiny_tokenizer)
    before = gate.stats()["chat"]
    datums = []
    for k, (what, spoil, needle) in enumerate(BAD_ROWS):
        row = equivalence_row("Reply with exactly: 1", "1")
        spoil(row)
        datum = datum_from_gym_row(row, idx=100 + k)
        t0 = time.monotonic()
        with pytest.raises(InvalidGymRow) as info:
            await manager.run_rollout(datum)
        assert time.monotonic() - t0 < 1.0, what
        assert f"prompt_idx={100 + k}" in str(info.value) and needle in str(info.value), (what, str(info.value))
        datums.append(datum)
    outcomes, sink, _ = await collect(manager, datums)
    assert outcomes == [RolloutOutcome.SKIPPED] * len(BAD_ROWS) and not sink.records
    assert counts(manager).get("rollout/data_failures_total/InvalidGymRow") == len(BAD_ROWS), counts(manager)
    assert gate.stats()["chat"] == before, "a malformed row reached the endpoint"


# ---- the endpoint misbehaves -----------------------------------------------------------------


async def test_endpoint_500_transient_recovers_and_persistent_is_typed(fault_gym, gate, tiny_tokenizer):
    """Fault: HTTP 500 from the endpoint. Expected: two 500s are absorbed by Gym's own 3 tries
    (COMMITTED); a persistent 500 is GymTransportError (infra), rows re-sent, then the prompt is
    dropped and counted, within 2 attempts x 2 row attempts x ~1.5 s."""
    gate.set("status", status=500, times=2)
    outcomes, _, _ = await collect(make_manager(fault_gym, tiny_tokenizer), [prompt(1)])
    assert outcomes == [RolloutOutcome.COMMITTED]
    assert gate.stats()["faulted"] == 2

    gate.set("status", status=500)
    manager = make_manager(fault_gym, tiny_tokenizer, max_infra_attempts=2, max_gym_row_attempts=2)
    with pytest.raises(GymTransportError, match="HTTP 500"):
        await manager.run_rollout(prompt(2))
    outcomes, sink, elapsed = await collect(manager, [prompt(2)])
    assert outcomes == [RolloutOutcome.SKIPPED] and not sink.records
    metrics = counts(manager)
    assert metrics.get("rollout/infra_drops_total/GymTransportError") == 1, metrics
    assert metrics.get("rollout/gym_row_redispatch_total") == 3 * N  # one re-send in run_rollout, two in collect, metrics
    assert elapsed < 4 * 1.5 + MARGIN_S


async def test_endpoint_429_transient_recovers_and_persistent_hits_the_deadline(fault_gym, gate, tiny_tokenizer):
    """Fault: HTTP 429. Expected: Gym retries 429, so a few are absorbed (COMMITTED); a persistent 429 ends
    at the group deadline as RolloutTimeout (Gym up to 0.6 retries it without limit) or, on Gym 0.7, which
    stops after 3 tries, as GymTransportError before it (infra either way), the prompt dropped."""
    gate.set("status", status=429, times=3)
    outcomes, _, _ = await collect(make_manager(fault_gym, tiny_tokenizer), [prompt(3)])
    assert outcomes == [RolloutOutcome.COMMITTED]

    gate.set("status", status=429)
    manager = make_manager(fault_gym, tiny_tokenizer, rollout_s=3.0)
    outcomes, sink, elapsed = await collect(manager, [prompt(4)])
    assert outcomes == [RolloutOutcome.SKIPPED] and not sink.records
    if installed_gym().rate_limits_retried_forever:  # Gym up to 0.6: only our deadline ends it
        assert counts(manager).get("rollout/infra_drops_total/RolloutTimeout") == 1, counts(manager)
        assert 3.0 <= elapsed < 3.0 + MARGIN_S
    else:  # Gym 0.7 gives up after 3 tries: a typed infrastructure failure before the deadline
        assert counts(manager).get("rollout/infra_drops_total/GymTransportError") == 1, counts(manager)
        assert elapsed < 3.0


async def test_context_length_400_is_a_data_failure_never_a_fake_zero(fault_gym, gate, tiny_tokenizer):
    """Fault: the endpoint's context-length 400, which Gym turns into an empty *successful* rollout
    with reward 0. Expected: MissingGenerationData (data), retried once, then SKIPPED and counted."""
    gate.set("status", status=400, message=CONTEXT_LENGTH_400)
    manager = make_manager(fault_gym, tiny_tokenizer, max_data_attempts=2)
    with pytest.raises(MissingGenerationData, match="no generation data|token"):
        await manager.run_rollout(prompt(5))
    outcomes, sink, elapsed = await collect(manager, [prompt(5)])
    assert outcomes == [RolloutOutcome.SKIPPED] and not sink.records
    metrics = counts(manager)
    assert metrics.get("rollout/data_retry_total/MissingGenerationData") == 1, metrics
    assert metrics.get("rollout/data_failures_total/MissingGenerationData") == 1, metrics
    assert elapsed < MARGIN_S


async def test_response_without_logprobs_is_typed(fault_gym, gate, tiny_tokenizer):
    """Fault: the endpoint drops logprobs. Expected: Gym's model server refuses the response; we
    raise GymTransportError carrying Gym's explanation, quickly; collect drops the prompt."""
    gate.set("no_logprobs")
    manager = make_manager(fault_gym, tiny_tokenizer)
    t0 = time.monotonic()
    with pytest.raises(GymTransportError, match="logprobs"):
        await manager.run_rollout(prompt(6))
    assert time.monotonic() - t0 < MARGIN_S
    outcomes, sink, _ = await collect(manager, [prompt(6)])
    assert outcomes == [RolloutOutcome.SKIPPED] and not sink.records


async def test_nan_logprobs_are_never_committed(fault_gym, gate, tiny_tokenizer):
    """Fault: NaN logprobs from the endpoint. Expected: a typed failure within seconds and the
    prompt SKIPPED; no NaN reaches the sink."""
    gate.set("nan_logprobs")
    manager = make_manager(fault_gym, tiny_tokenizer)
    outcomes, sink, elapsed = await collect(manager, [prompt(7)])
    assert outcomes == [RolloutOutcome.SKIPPED] and not sink.records
    assert elapsed < MARGIN_S
    reasons = [k for k, v in counts(manager).items() if v and "/" in k.removeprefix("rollout/")]
    assert reasons, "the failure was not counted"


async def test_slow_endpoint_hits_the_group_deadline(fault_gym, gate, tiny_tokenizer):
    """Fault: responses slower than the deadline. Expected: RolloutTimeout at rollout_s, not later."""
    gate.set("delay", delay_s=8.0)
    manager = make_manager(fault_gym, tiny_tokenizer, rollout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(RolloutTimeout, match=r"exceeded 2\.0s"):
        await manager.run_rollout(prompt(8))
    assert time.monotonic() - t0 < 2.0 + MARGIN_S


async def test_endpoint_killed_mid_batch_then_restarted_recovers(fault_gym, gate, tiny_tokenizer):
    """Fault: the endpoint process is SIGKILLed with rows in flight and comes back 2 s later.
    Expected: Gym retries the refused connections; every group COMMITTED, all rows, no duplicate."""
    gate.set("delay", delay_s=1.0)
    manager = make_manager(fault_gym, tiny_tokenizer, rollout_s=60.0, max_infra_attempts=2)
    seen = gate.stats()["chat"]
    task = asyncio.ensure_future(collect(manager, [prompt(10), prompt(11)]))
    await rows_in_flight(gate, seen)
    gate.kill()
    await asyncio.sleep(2.0)  # the scenario's downtime (not a wait for anything): Gym retries meanwhile
    gate.start()
    outcomes, sink, elapsed = await asyncio.wait_for(task, 60 + MARGIN_S)
    assert outcomes == [RolloutOutcome.COMMITTED] * 2
    assert len(sink.records) == 2


async def test_endpoint_killed_and_not_restarted_stops_the_run(fault_gym, gate, tiny_tokenizer):
    """Fault: the endpoint is gone for good. Expected: each attempt ends at the group deadline
    (Gym itself would wait forever); the first prompt is dropped, the second exceeds
    max_consecutive_dropped_prompts=1 and stops the run with RolloutRedispatchExhausted."""
    gate.kill()
    manager = make_manager(fault_gym, tiny_tokenizer, rollout_s=2.0, max_infra_attempts=2,
                           max_consecutive_dropped_prompts=1)
    sink = InMemorySink()
    t0 = time.monotonic()
    assert await manager.collect(prompt(12), sink) is RolloutOutcome.SKIPPED
    # Each attempt ends at the 2 s deadline; once the endpoint refused connections for connect_timeout_s
    # (10 s) across attempts, the health watch's EndpointUnavailable may end the last one first.
    with pytest.raises(RolloutRedispatchExhausted, match="RolloutTimeout|EndpointUnavailable") as info:
        await manager.collect(prompt(13), sink)
    elapsed = time.monotonic() - t0
    assert "max_consecutive_dropped_prompts=1" in str(info.value)
    assert not sink.records and not sink.reserved
    assert elapsed < 4 * 2.0 + 2 * 0.2 + MARGIN_S


TOOLS_400 = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


async def test_endpoint_4xx_is_a_configuration_failure_never_redispatched(fault_gym, gate, tiny_tokenizer):
    """Fault: the model endpoint answers 4xx: our server's real 404 for a model it does not serve (the gate
    renames the model), and vLLM's 400 for tools. Expected: EndpointConfigError (data) with the endpoint's
    own message and Gym's server path, unescaped; no row or prompt re-dispatched, no data retry."""
    gate.set("rename_model", model="no-such-model")
    manager = make_manager(fault_gym, tiny_tokenizer, max_infra_attempts=3, max_gym_row_attempts=3, max_data_attempts=2)
    t0 = time.monotonic()
    with pytest.raises(EndpointConfigError) as info:
        await manager.run_rollout(prompt(14))
    assert time.monotonic() - t0 < MARGIN_S
    error = info.value
    assert error.status == 404 and error.detail.startswith("The model `no-such-model` does not exist"), str(error)
    assert "policy_model (VLLMModel) > model endpoint" in error.path and "\\" not in str(error), str(error)
    assert not counts(manager), counts(manager)

    gate.set("status", status=400, message=TOOLS_400)
    with pytest.raises(EndpointConfigError, match="--enable-auto-tool-choice") as info:
        await manager.run_rollout(prompt(15))
    assert info.value.status == 400

    gate.set("pass")  # after a committed group, a configuration error is one prompt's problem: skipped
    assert await manager.collect(prompt(16), InMemorySink()) is RolloutOutcome.COMMITTED
    gate.set("rename_model", model="no-such-model")
    outcomes, sink, _ = await collect(manager, [prompt(17), prompt(18)])
    assert outcomes == [RolloutOutcome.SKIPPED] * 2 and not sink.records
    metrics = counts(manager)
    assert metrics.get("rollout/data_failures_total/EndpointConfigError") == 2, metrics
    assert not any(k.startswith(("rollout/redispatch", "rollout/gym_row", "rollout/data_retry")) for k in metrics)


async def test_first_groups_failing_with_one_config_error_stop_the_run_at_once(fault_gym, gate, tiny_tokenizer):
    """Fault: every request gets the endpoint's 404 from the first group on. Expected: the run stops at once
    with RunConfigurationError naming the endpoint's message, after the first 2 groups, no row sent twice."""
    gate.set("rename_model", model="no-such-model")
    before = gate.stats()["chat"]
    manager = make_manager(fault_gym, tiny_tokenizer, max_infra_attempts=3, max_gym_row_attempts=3, max_data_attempts=2)
    sink = InMemorySink()
    t0 = time.monotonic()
    with pytest.raises(RunConfigurationError, match="does not exist") as info:
        for k in range(19, 25):
            await manager.collect(prompt(k), sink)
    assert time.monotonic() - t0 < 2 * MARGIN_S
    assert "first 2 prompt groups" in str(info.value) and "policy_model (VLLMModel)" in str(info.value)
    assert isinstance(info.value.__cause__, EndpointConfigError)
    # Each row reaches the endpoint at most once per try of Gym's own model client (3 on Gym 0.7, which
    # retries 404); a group's first failure cancels its rows not yet sent, so a group may show fewer than
    # N rows. Nothing was retried or re-dispatched by us.
    tries = 3 if 404 in installed_gym().model_client_retry_statuses else 1
    sent = gate.stats()["chat"] - before
    assert 2 <= sent <= 2 * N * tries, f"{sent} requests for 2 groups of {N} rows"
    metrics = counts(manager)
    assert metrics.get("rollout/data_failures_total/EndpointConfigError") == 2, metrics
    assert not any(k.startswith(("rollout/redispatch", "rollout/gym_row", "rollout/data_retry")) for k in metrics)
    assert not sink.records and not sink.reserved


async def test_endpoint_killed_mid_run_is_found_within_connect_timeout(fault_gym, gate, tiny_tokenizer):
    """Fault: the endpoint is SIGKILLed with rows in flight and stays down; the group deadline is long.
    Expected: the actor's health watch probes the endpoints and fails the stream with EndpointUnavailable
    naming the URL once it refused connections for connect_timeout_s; the retry fails at its first probe;
    the run stops (max_consecutive_dropped_prompts=0) long before the group deadline."""
    cfg = await fault_gym.server_info.remote()  # the actor is up
    assert cfg["urls"]
    gate.set("delay", delay_s=3.0)
    before = gate.stats()["chat"]
    manager = make_manager(fault_gym, tiny_tokenizer, rollout_s=300.0, max_infra_attempts=2,
                           max_consecutive_dropped_prompts=0)
    sink = InMemorySink()
    task = asyncio.ensure_future(manager.collect(prompt(26), sink))
    await async_wait_until(lambda: gate.stats()["chat"] > before, 10, "a row reaches the endpoint", poll_s=0.05)
    t0 = time.monotonic()
    gate.kill()
    with pytest.raises(RolloutRedispatchExhausted) as info:
        await asyncio.wait_for(task, 120)
    elapsed = time.monotonic() - t0
    cause = info.value.__cause__
    assert isinstance(cause, EndpointUnavailable), repr(cause)
    assert gate.base_url in str(cause) and "refused connections" in str(cause)
    connect_timeout_s, health_poll_s = 10.0, 0.5  # NemoGymConfig's default; the fixture's poll
    assert elapsed < connect_timeout_s + 3 * health_poll_s + 0.2 + MARGIN_S, elapsed  # well before rollout_s=300
    assert not sink.records and not sink.reserved


# ---- the stream itself misbehaves ------------------------------------------------------------


@ray.remote(num_cpus=0)
class TamperingRelay:
    """Relays the real actor's stream, tampering with the row indices as planned."""

    def __init__(self, inner, plan: str):
        self.inner, self.plan, self.calls = inner, plan, 0

    async def routes(self):
        return await self.inner.routes.remote()

    async def run_row_batches(self, rows, timer_prefix):
        self.calls += 1
        k = 0
        async for ref in self.inner.run_row_batches.options(num_returns="streaming").remote(rows, timer_prefix):
            batch = await ref
            for result in batch.rows:
                rowidx = result.row_index
                if self.plan == "never_dispatched" and self.calls == 1 and k == len(rows) - 1:
                    raise GymTransportError("injected: the last row was lost")
                if self.plan == "never_dispatched" and self.calls == 2:  # a row that arrived in the first attempt
                    rowidx = min(set(range(N)) - {row["_rowidx"] for row in rows})
                if self.plan == "out_of_range":
                    rowidx += 100
                yield GymRowBatch([dataclasses.replace(result, row_index=rowidx)], batch.timing)
                if self.plan == "duplicate":
                    yield GymRowBatch([dataclasses.replace(result, row_index=rowidx)])
                k += 1


@pytest.mark.parametrize(
    ("plan", "needle"),
    [("duplicate", "duplicate row index"), ("out_of_range", "came back, which was not dispatched"),
     ("never_dispatched", "which was not dispatched")],
)
async def test_bad_stream_indices_are_rejected(fault_gym, tiny_tokenizer, plan, needle):
    """Fault: real Gym results relayed with a duplicate, out-of-range or never-dispatched row index.
    Expected: GymRowIndexError (infra) naming the index; collect drops the prompt, nothing committed."""
    relays = [TamperingRelay.remote(fault_gym, plan) for _ in range(2)]  # one per run: the plan counts calls
    try:
        # the relays' processes start before the group's 30 s clock does (on a loaded machine a new actor takes a while)
        ray.get([relay.routes.remote() for relay in relays], timeout=180)
        manager = make_manager(relays[0], tiny_tokenizer, max_gym_row_attempts=2)
        with pytest.raises(GymRowIndexError, match=needle):
            await manager.run_rollout(prompt(20))
        manager = make_manager(relays[1], tiny_tokenizer, max_gym_row_attempts=2)
        outcomes, sink, _ = await collect(manager, [prompt(21)])
        assert outcomes == [RolloutOutcome.SKIPPED] and not sink.records
        assert counts(manager).get("rollout/infra_drops_total/GymRowIndexError") == 1, counts(manager)
    finally:
        for relay in relays:
            ray.kill(relay)


# ---- two NemoGym actors behind one manager -------------------------------------------------


async def test_two_actors_share_the_load_and_fail_over(fault_gym, gym_actor, gate, tiny_tokenizer):
    """Two actors, each with its own Gym servers (the module's, behind the gate, and the session's).
    Groups go to the actor with the fewest rows in flight, so both get work; when one actor's
    endpoint fails, the lost rows are re-sent to the other and every group is COMMITTED."""
    manager = make_manager([fault_gym, gym_actor], tiny_tokenizer, max_gym_row_attempts=2)
    before = gate.stats()["chat"]
    outcomes, sink, _ = await collect(manager, [prompt(60 + k) for k in range(6)])
    assert outcomes == [RolloutOutcome.COMMITTED] * 6
    through_gate = gate.stats()["chat"] - before
    assert 0 < through_gate < 6 * N, f"{through_gate} of {6 * N} rows went through the first actor"
    assert manager.backend.in_flight_rows == [0, 0]

    gate.set("status", status=500)  # the first actor's endpoint breaks
    outcomes, sink, _ = await collect(manager, [prompt(70 + k) for k in range(4)])
    assert outcomes == [RolloutOutcome.COMMITTED] * 4
    assert counts(manager).get("rollout/gym_row_redispatch_total", 0) > 0, counts(manager)
    assert manager.backend.in_flight_rows == [0, 0]


# ---- safety: loopback only, no secret in logs or results ------------------------------------


def _runs_ray(pid: int) -> bool:
    """Whether the process has Ray's core library loaded (Ray's gRPC listener binds all interfaces)."""
    try:
        return "_raylet" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _listening(pids) -> list[tuple[int, str, int]]:
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections("inet")
        except psutil.NoSuchProcess:
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


async def test_every_socket_is_loopback_and_the_api_key_is_never_written(fault_gym, gate, scripted_policy,
                                                                          tiny_tokenizer, tmp_path):
    """Every listening socket of the processes gym-bridge started for this run (Gym's launcher and
    servers, the gate, our server's port) is on loopback; the planted API key appears in no Gym log,
    no Ray worker log, no result and no log record of this process. Ray's own listeners are not ours
    to bind and are excluded (docs/reliability.md)."""
    import json
    import logging

    records: list[str] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    try:
        manager = make_manager(fault_gym, tiny_tokenizer)
        gate.set("status", status=500, times=2)  # exercise the error paths too
        _, sink, _ = await collect(manager, [prompt(50), prompt(51)])
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert len(sink.records) == 2
    assert gate.stats()["auth"] == f"Bearer {PLANTED_API_KEY}", "the planted key must really be in use"

    info = await fault_gym.server_info.remote()
    gym_pids = set(info["pids"])
    assert len(gym_pids) >= 4, info  # launcher, reaper, 3 servers (and their shells)
    sockets = _listening(gym_pids | {gate.proc.pid})
    ports = {port for _, _, port in sockets}
    assert {int(u.rsplit(":", 1)[1]) for u in info["urls"].values()} <= ports, (info["urls"], sockets)
    exposed = [(pid, ip, port) for pid, ip, port in sockets if ip not in ("127.0.0.1", "::1")]
    assert all(_runs_ray(pid) for pid, _, _ in exposed), f"non-loopback listeners not owned by Ray: {exposed}"
    assert not {int(u.rsplit(":", 1)[1]) for u in info["urls"].values()} & {port for _, _, port in exposed}
    policy_port = int(scripted_policy.root_url.rsplit(":", 1)[1])
    ours = [s for s in _listening([os.getpid()]) if s[2] == policy_port]
    assert ours and all(ip == "127.0.0.1" for _, ip, _ in ours), ours

    outputs = [json.dumps([c.env_extras for c in r.completions], default=str) for r in sink.records]
    texts = {"log records": "\n".join(records), "results": "\n".join(outputs)}
    log_dirs = [Path(info["log_dir"]), Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"]
    files = [f for d in log_dirs for f in d.rglob("*") if f.is_file()]
    assert any(f.suffix == ".log" for f in files)
    leaks = [name for name, text in texts.items() if PLANTED_API_KEY in text]
    leaks += [str(f) for f in files if PLANTED_API_KEY.encode() in f.read_bytes()]
    assert not leaks, f"the API key was written to: {leaks}"


# ---- Gym and the actor die (these break the module's Gym: keep them last) ---------------------


def _resources_server(info: dict) -> tuple[str, int]:
    names = [n for n, t in info["server_types"].items() if t == "resources_servers"]
    assert len(names) == 1, info["server_types"]
    return names[0], info["server_pids"][names[0]]


async def _kill_when_answering(fault_gym, name: str, pid: int, timeout_s: float = 120.0) -> int:
    """SIGKILL server ``name`` (``pid``) and return the pid its restart runs under once the actor sees it answer."""
    os.kill(pid, signal.SIGKILL)

    async def restarted() -> int | None:
        try:
            await fault_gym.health_check.remote()  # the actor's poll, which takes up the new process
        except NemoGymUnavailable:
            return None
        new = int((await fault_gym.server_info.remote())["server_pids"][name])
        return new if new != pid else None

    return await async_wait_until(restarted, timeout_s, f"{name} restarted and answering", poll_s=0.25)


def _server_of_type(info: dict, server_type: str) -> tuple[str, int]:
    names = sorted(n for n, t in info["server_types"].items() if t == server_type)
    assert names, info["server_types"]
    return names[0], info["server_pids"][names[0]]


@pytest.mark.parametrize("server_type", ["resources_servers", "responses_api_agents", "responses_api_models"])
async def test_a_gym_server_killed_mid_run_is_restarted_and_its_rows_re_sent(
    fault_gym, gate, tiny_tokenizer, server_type
):
    """Fault: one Gym server of each kind (resources, agent, model) is SIGKILLed while rows are in flight.
    Expected: the health watch fails the stream within ~health_poll_s (NemoGymServerRestarting, counted as a
    re-dispatch of that reason; or, when the dropped connection fails the row first, GymTransportError), the launcher starts the server again on its port, the re-sent rows wait before
    dispatch until it answers, and the group commits with every completion graded by the verifier (reward 1.0,
    none faked)."""
    name, pid = _server_of_type(await fault_gym.server_info.remote(), server_type)
    gate.set("delay", delay_s=2.0)
    manager = make_manager(fault_gym, tiny_tokenizer, max_infra_attempts=3, max_gym_row_attempts=1,
                           max_consecutive_dropped_prompts=0)  # fmt: skip
    seen = gate.stats()["chat"]
    task = asyncio.ensure_future(collect(manager, [prompt(30)]))
    await rows_in_flight(gate, seen)
    os.kill(pid, signal.SIGKILL)
    outcomes, sink, _ = await asyncio.wait_for(task, 120)
    assert outcomes == [RolloutOutcome.COMMITTED], f"last error: {sink.last_error}"
    # NemoGymServerRestarting when the health watch sees the exit first; a /run whose connection dropped before the
    # launcher's next poll is the transport error of the same loss, re-sent the same way
    reasons = ("NemoGymServerRestarting", "GymTransportError")
    assert sum(counts(manager).get(f"rollout/redispatch_total/{r}", 0) for r in reasons) >= 1, counts(manager)
    info = await fault_gym.server_info.remote()
    assert info["server_pids"][name] != pid, "a new process serves the resources server"
    log = Path(info["log_dir"]) / f"{name}.log"
    assert "exited with code -9; restarting it (1 of 3)" in log.read_text()
    await fault_gym.health_check.remote()


async def test_a_resources_server_that_keeps_dying_stops_the_run_in_one_line_naming_it(fault_gym, gate, tiny_tokenizer):
    """Fault: the resources server is killed after each restart, once more than its 3 allowed restarts. Expected:
    the next group stops the run (GymServerCrashLoop, not a dropped or skipped prompt) with one line naming the
    server and its log file, and no record is committed."""
    name, pid = _resources_server(await fault_gym.server_info.remote())
    info = await fault_gym.server_info.remote()
    restarts = int((Path(info["log_dir"]) / f"{name}.log").read_text().count("restarting it ("))
    for _ in range(3 - restarts):
        pid = await _kill_when_answering(fault_gym, name, pid)
    os.kill(pid, signal.SIGKILL)
    manager = make_manager(fault_gym, tiny_tokenizer, max_infra_attempts=3, max_gym_row_attempts=1,
                           max_consecutive_dropped_prompts=0)  # fmt: skip
    sink = InMemorySink()
    t0 = time.monotonic()
    with pytest.raises(GymServerCrashLoop) as raised:
        await asyncio.wait_for(manager.collect(prompt(31), sink), 60)
    assert time.monotonic() - t0 < 2.0 + MARGIN_S
    message = str(raised.value).strip().splitlines()[-1]
    assert f"NeMo-Gym server '{name}' exited (code -9) after its last allowed restart (3 of 3)" in message, message
    assert f"its log: {Path(info['log_dir']) / f'{name}.log'}" in message, message
    assert not sink.records and not sink.reserved


async def test_actor_killed_is_restarted_by_ray_and_respins(fault_gym, gate, tiny_tokenizer):
    """Fault: the NemoGym actor process is killed with rows in flight (on_restart="respin").
    Expected: the stream fails with a Ray actor error (infra); Ray restarts the actor, whose first
    call starts fresh Gym servers; the retried prompt is COMMITTED; the old Gym processes are gone."""
    await fault_gym.shutdown.remote()  # the test before killed a Gym server: rows need a healthy Gym to be in flight
    await fault_gym.spinup.remote()
    old_pids = (await fault_gym.server_info.remote())["pids"]
    gate.set("delay", delay_s=1.0)
    manager = make_manager(fault_gym, tiny_tokenizer, rollout_s=240.0, max_infra_attempts=8,
                           backoff_base_s=2.0, max_backoff_s=10.0)  # calls fail fast while Ray restarts it
    seen = gate.stats()["chat"]
    task = asyncio.ensure_future(collect(manager, [prompt(40)]))
    await rows_in_flight(gate, seen)
    ray.kill(fault_gym, no_restart=False)
    outcomes, sink, _ = await asyncio.wait_for(task, 400)
    assert outcomes == [RolloutOutcome.COMMITTED], f"last error: {sink.last_error}"
    assert len(sink.records) == 1
    assert counts(manager).get("rollout/redispatch_total") >= 1, counts(manager)
    _, alive = psutil.wait_procs([p for p in map(_process, old_pids) if p], timeout=30)
    assert not alive, f"old Gym processes survived the actor: {[(p.pid, _describe(p)) for p in alive]}"
    await fault_gym.health_check.remote()

    new_pids = (await fault_gym.server_info.remote())["pids"]
    await fault_gym.shutdown.remote()
    await fault_gym.shutdown.remote()  # idempotent
    _, alive = psutil.wait_procs([p for p in map(_process, new_pids) if p], timeout=30)
    assert not alive, f"shutdown left Gym processes: {[(p.pid, _describe(p)) for p in alive]}"
    with pytest.raises(NemoGymUnavailable, match=r"spinup\(\) was never called"):
        await fault_gym.health_check.remote()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pgid={os.getpgid(proc.pid)} ppid={proc.ppid()} {' '.join(proc.cmdline())[:200]}"
    except (OSError, psutil.Error) as exc:
        return repr(exc)
