from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys

import aiohttp
import httpx
import multidict
import pytest
import ray.exceptions
import yarl

import gym_bridge.failures
from gym_bridge.failures import (
    FailureClass,
    GenerationUnavailable,
    GymTransportError,
    RolloutDataFailure,
    RolloutFailure,
    RolloutInfraFailure,
    RolloutRedispatchExhausted,
    RolloutTimeout,
    RolloutTimeouts,
    classify_generation_failure,
    classify_rollout_failure,
    deadline,
    gather_cancel_siblings,
    http_status_is_infra,
    typed_gym_failure,
)

INFRA, DATA = FailureClass.INFRA, FailureClass.DATA
GYM_RETRY_STATUSES = [429, 500, 502, 503, 504, 520]
ALL_FAILURE_TYPES = [
    obj for name in gym_bridge.failures.__all__
    if isinstance(obj := getattr(gym_bridge.failures, name), type) and issubclass(obj, Exception)
]


def aiohttp_response_error(status: int) -> aiohttp.ClientResponseError:
    """What aiohttp raises for ``raise_for_status()``: headers are unpicklable CIMultiDictProxy objects."""
    url = yarl.URL("http://127.0.0.1:8000/run")
    headers = multidict.CIMultiDictProxy(multidict.CIMultiDict({"Content-Type": "application/json"}))
    info = aiohttp.RequestInfo(url, "POST", headers, url)
    return aiohttp.ClientResponseError(info, (), status=status, message="upstream said no", headers=headers)


def httpx_status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:8000/run")
    response = httpx.Response(status, request=request)
    return httpx.HTTPStatusError(f"status {status}", request=request, response=response)


def chain(*excs: BaseException) -> BaseException:
    """``excs[0]`` raised from ``excs[1]`` raised from ... ."""
    for outer, inner in zip(excs, excs[1:]):
        outer.__cause__ = inner
    return excs[0]


# --- the tree ------------------------------------------------------------------------


def test_tree_shape():
    for cls in (RolloutTimeout, GenerationUnavailable, GymTransportError):
        assert issubclass(cls, RolloutInfraFailure)
    assert issubclass(RolloutInfraFailure, RolloutFailure)
    assert issubclass(RolloutDataFailure, RolloutFailure)
    assert not issubclass(RolloutDataFailure, RolloutInfraFailure)
    assert FailureClass("infra") is INFRA and INFRA == "infra" and DATA == "data"


def test_terminal_errors_are_not_rollout_failures():
    for cls in (RolloutRedispatchExhausted,):
        assert issubclass(cls, RuntimeError)
        assert not issubclass(cls, RolloutFailure)
    with pytest.raises(RolloutRedispatchExhausted):
        try:
            raise RolloutRedispatchExhausted("prompt 3 spent 5 infra attempts")
        except RolloutFailure:  # a per-attempt handler must not swallow it
            pytest.fail("caught by a RolloutFailure handler")


def test_the_package_docstring_draws_every_exception_class_once():
    tree = gym_bridge.failures.__doc__.split("::", 1)[1].split("\n\n\n", 1)[0]
    assert len(ALL_FAILURE_TYPES) >= 20
    for cls in ALL_FAILURE_TYPES:
        assert cls.__module__ == "gym_bridge.failures.errors", cls
        drawn = [line for line in tree.splitlines() if line.strip().lstrip("├└─│ ").split(" ")[0] == cls.__name__]
        assert len(drawn) == 1, (cls.__name__, drawn)


def test_moved_classes_still_import_from_where_they_were_raised():
    from gym_bridge.failures import (
        EngineShutDownError,
        GymResultError,
        GymRowIndexError,
        GymServerDied,
        GymServersError,
        GymStartupError,
        MissingGenerationData,
        NaNLogprobs,
        NemoGymRestarted,
        NemoGymUnavailable,
        TokenDrift,
    )
    from gym_bridge.gym.protocol.rows import InvalidGymRow

    for cls in (EngineShutDownError, NemoGymRestarted, NemoGymUnavailable, GymResultError, MissingGenerationData,
                NaNLogprobs, TokenDrift, InvalidGymRow, GymServerDied, GymServersError, GymStartupError,
                GymRowIndexError):
        assert getattr(gym_bridge.failures, cls.__name__) is cls


@pytest.mark.parametrize("cls", ALL_FAILURE_TYPES)
def test_every_failure_pickles_with_its_message_even_with_an_unpicklable_cause(cls):
    exc = cls("prompt_idx=3 went wrong")
    exc.__cause__ = aiohttp_response_error(503)
    restored = pickle.loads(pickle.dumps(exc))
    assert type(restored) is cls
    assert str(restored) == "prompt_idx=3 went wrong"


def test_the_package_imports_no_ray_torch_or_http_library():
    code = (
        "import sys\n"
        "import gym_bridge.failures\n"
        "heavy = {'ray', 'torch', 'aiohttp', 'httpx'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- classify_rollout_failure ----------------------------------------------------------


class ServerDisconnectedError(Exception):
    """An aiohttp-named error seen without aiohttp's class: the name fallback applies."""


class ClientOSError(OSError):
    pass


class WrappedClientOSError(ClientOSError):
    pass


@pytest.mark.parametrize(
    "exc",
    [
        RolloutInfraFailure("x"),
        RolloutTimeout("x"),
        GenerationUnavailable("x"),
        GymTransportError("x"),
        TimeoutError("x"),
        asyncio.TimeoutError("x"),
        ConnectionError("x"),
        ConnectionResetError("x"),
        ray.exceptions.RayActorError(),
        ray.exceptions.ActorUnavailableError("actor restarting", None),
        ray.exceptions.WorkerCrashedError(),
        ray.exceptions.GetTimeoutError(),
        ray.exceptions.NodeDiedError("node gone"),
        ray.exceptions.OutOfMemoryError("oom"),
        aiohttp.ClientConnectionError("x"),
        aiohttp.ClientOSError(104, "connection reset"),
        aiohttp.ServerDisconnectedError(),
        aiohttp.ServerTimeoutError("x"),
        aiohttp.ClientPayloadError("truncated body"),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("peer closed"),
        ServerDisconnectedError("fallback by name"),
        WrappedClientOSError("fallback by a name in the MRO"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_infra_types_are_infra(exc):
    assert classify_rollout_failure(exc) is INFRA


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("x"),
        KeyError("x"),
        RuntimeError("x"),
        AssertionError("x"),
        OSError("disk full"),
        RolloutDataFailure("x"),
        RolloutRedispatchExhausted("x"),
        httpx.UnsupportedProtocol("ftp://"),
        aiohttp.ClientError("generic"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_unknown_and_data_errors_are_data(exc):
    assert classify_rollout_failure(exc) is DATA


def test_a_ray_task_error_carrying_an_infra_cause_class_is_infra():
    exc = ray.exceptions.RayTaskError("generate", "tb", ConnectionError("down")).as_instanceof_cause()
    assert classify_rollout_failure(exc) is INFRA
    plain = ray.exceptions.RayTaskError("generate", "tb", ValueError("bad prompt")).as_instanceof_cause()
    assert classify_rollout_failure(plain) is DATA


@pytest.mark.parametrize("status", [500, 501, 502, 503, 504, 520, 599, 408, 429])
def test_server_statuses_are_infra(status):
    assert http_status_is_infra(status)
    assert classify_rollout_failure(aiohttp_response_error(status)) is INFRA
    assert classify_rollout_failure(httpx_status_error(status)) is INFRA


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 422])
def test_other_client_statuses_are_data(status):
    assert not http_status_is_infra(status)
    assert classify_rollout_failure(aiohttp_response_error(status)) is DATA
    assert classify_rollout_failure(httpx_status_error(status)) is DATA


@pytest.mark.parametrize("status", GYM_RETRY_STATUSES)
def test_every_status_gyms_client_retries_is_infra(status):
    assert http_status_is_infra(status)
    assert classify_rollout_failure(typed_gym_failure(aiohttp_response_error(status))) is INFRA


def test_a_4xx_response_error_is_not_infra_but_its_cause_still_counts():
    exc = chain(aiohttp_response_error(404), ConnectionResetError("reset"))
    assert classify_rollout_failure(exc) is INFRA


def test_infra_cause_promotes_the_wrapper():
    assert classify_rollout_failure(chain(RuntimeError("wrapped"), ConnectionError("down"))) is INFRA


def test_explicit_data_failure_wins_over_an_infra_cause():
    assert classify_rollout_failure(chain(RolloutDataFailure("bad row"), ConnectionError("down"))) is DATA


def test_multi_level_chain_is_walked():
    exc = chain(RuntimeError("a"), ValueError("b"), KeyError("c"), ray.exceptions.WorkerCrashedError())
    assert classify_rollout_failure(exc) is INFRA


def test_cyclic_chain_terminates():
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert classify_rollout_failure(a) is DATA
    c = TimeoutError("c")
    a.__cause__, b.__cause__, c.__cause__ = b, c, a
    assert classify_rollout_failure(a) is INFRA


def test_chain_walk_stops_after_eight_links():
    def deep(infra_at: int, length: int = 20) -> BaseException:
        links: list[BaseException] = [ValueError(str(i)) for i in range(length)]
        links[infra_at] = ConnectionError("down")
        return chain(*links)

    assert classify_rollout_failure(deep(infra_at=7)) is INFRA
    assert classify_rollout_failure(deep(infra_at=8)) is DATA
    assert classify_rollout_failure(deep(infra_at=19)) is DATA


def test_context_is_ignored():
    try:
        try:
            raise ConnectionError("down")
        except ConnectionError:
            raise ValueError("while handling")  # implicit __context__ only
    except ValueError as exc:
        assert exc.__context__ is not None and exc.__cause__ is None
        assert classify_rollout_failure(exc) is DATA


# --- typed_gym_failure -------------------------------------------------------------------


def test_a_realistic_aiohttp_error_does_not_survive_pickling():
    with pytest.raises(TypeError):
        pickle.dumps(aiohttp_response_error(503))


@pytest.mark.parametrize("status", GYM_RETRY_STATUSES)
def test_typed_gym_failure_pickles_and_classifies_like_the_raw_error(status):
    raw = aiohttp_response_error(status)
    typed = typed_gym_failure(raw)
    assert isinstance(typed, GymTransportError)
    assert str(typed) == f"NeMo-Gym /run failed with HTTP {status}: upstream said no"
    restored = pickle.loads(pickle.dumps(typed))
    assert type(restored) is GymTransportError
    assert classify_rollout_failure(restored) is classify_rollout_failure(raw) is INFRA


def test_typed_gym_failure_for_a_client_status_is_data():
    typed = typed_gym_failure(aiohttp_response_error(422))
    assert type(typed) is RolloutDataFailure
    assert "HTTP 422" in str(typed)
    assert classify_rollout_failure(pickle.loads(pickle.dumps(typed))) is DATA


def test_both_sides_share_http_status_is_infra():
    for status in range(400, 600):
        typed = typed_gym_failure(aiohttp_response_error(status))
        assert classify_rollout_failure(typed) is classify_rollout_failure(aiohttp_response_error(status))
        assert isinstance(typed, GymTransportError) is http_status_is_infra(status)


def test_typed_gym_failure_handles_httpx_status_errors():
    typed = typed_gym_failure(httpx_status_error(502))
    assert isinstance(typed, GymTransportError) and "HTTP 502" in str(typed)


@pytest.mark.parametrize(
    "exc",
    [aiohttp.ServerDisconnectedError(), ConnectionError("down"), ValueError("bad json"), httpx.ReadTimeout("t")],
    ids=lambda e: type(e).__name__,
)
def test_errors_without_a_status_are_left_untouched(exc):
    assert typed_gym_failure(exc) is exc


# --- classify_generation_failure -------------------------------------------------------


def test_a_dead_ray_worker_is_generation_unavailable_naming_prompt_and_trajectory():
    failure = classify_generation_failure(ray.exceptions.RayActorError(), 12, 3)
    assert type(failure) is GenerationUnavailable
    assert str(failure).startswith("generation unavailable for prompt_idx=12 traj_idx=3: RayActorError")
    assert classify_rollout_failure(failure) is INFRA


def test_any_ray_boundary_error_is_infra_for_generation():
    boundary = ray.exceptions.RayTaskError("generate", "CUDA out of memory", RuntimeError("oom"))
    assert classify_rollout_failure(boundary) is DATA
    assert type(classify_generation_failure(boundary, 0, 0)) is GenerationUnavailable


def test_infra_classified_error_is_generation_unavailable():
    assert type(classify_generation_failure(ConnectionError("down"), 0, 1)) is GenerationUnavailable


def test_deterministic_generation_error_is_data():
    failure = classify_generation_failure(ValueError("prompt too long"), 5, 0)
    assert type(failure) is RolloutDataFailure
    assert str(failure) == "generation failed for prompt_idx=5 traj_idx=0: ValueError: prompt too long"


def test_explicit_data_failure_across_ray_stays_data():
    carried = ray.exceptions.RayTaskError("generate", "tb", RolloutDataFailure("bad")).as_instanceof_cause()
    assert type(classify_generation_failure(carried, 0, 0)) is RolloutDataFailure


def test_cancellation_is_never_reclassified():
    with pytest.raises(TypeError):
        classify_generation_failure(asyncio.CancelledError(), 0, 0)  # type: ignore[arg-type]


# --- RolloutTimeouts ---------------------------------------------------------------------


def test_rollout_timeouts_default_to_no_deadline_and_validate():
    t = RolloutTimeouts()
    assert (t.rollout_s, t.generation_s, t.env_s) == (None, None, None)
    assert RolloutTimeouts(rollout_s=30, env_s=0.5).env_s == 0.5
    for bad in (0, -1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="generation_s"):
            RolloutTimeouts(generation_s=bad)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        t.rollout_s = 1.0  # type: ignore[misc]


# --- deadline ------------------------------------------------------------------------------


async def test_hung_body_becomes_rollout_timeout_and_is_cancelled():
    cancelled = asyncio.Event()

    async def hang():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(RolloutTimeout, match=r"^generation turn exceeded 0.05s$") as info:
        async with deadline(0.05, "generation turn"):
            await hang()
    assert isinstance(info.value.__cause__, TimeoutError)
    assert cancelled.is_set()
    assert classify_rollout_failure(info.value) is INFRA


async def test_none_disables_the_deadline():
    async with deadline(None, "environment step"):
        await asyncio.sleep(0.05)
    # and it really is unbounded: only the outer timeout ends this wait
    with pytest.raises(TimeoutError) as info:
        async with asyncio.timeout(0.05):
            async with deadline(None, "environment step"):
                await asyncio.sleep(60)
    assert not isinstance(info.value, RolloutTimeout)


async def test_slow_but_in_time_passes():
    async with deadline(1.0, "environment step"):
        await asyncio.sleep(0.05)
        result = "done"
    assert result == "done"


async def test_inner_timeout_error_is_not_relabelled():
    mine = TimeoutError("the body's own timeout")
    with pytest.raises(TimeoutError) as info:
        async with deadline(5, "generation turn"):
            raise mine
    assert info.value is mine
    with pytest.raises(TimeoutError) as info:
        async with deadline(5, "generation turn"):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(60)
    assert not isinstance(info.value, RolloutTimeout)


async def test_an_outer_deadline_expiring_is_not_this_deadline():
    with pytest.raises(TimeoutError) as info:
        async with asyncio.timeout(0.05):
            async with deadline(5, "generation turn"):
                await asyncio.sleep(60)
    assert not isinstance(info.value, RolloutTimeout)


async def test_outer_cancellation_stays_cancellation():
    started = asyncio.Event()

    async def guarded():
        async with deadline(5, "NeMo-Gym prompt group"):
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(guarded())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_deadline_rejects_non_positive_seconds():
    with pytest.raises(ValueError):
        async with deadline(0, "x"):
            pass


# --- gather_cancel_siblings -----------------------------------------------------------------


async def test_gather_returns_results_in_input_order():
    async def value(v, delay):
        await asyncio.sleep(delay)
        return v

    assert await gather_cancel_siblings(value("a", 0.03), value("b", 0.0), value("c", 0.01)) == ["a", "b", "c"]
    assert await gather_cancel_siblings() == []


async def test_gather_failure_cancels_and_drains_siblings_then_raises_the_original():
    events: list[str] = []

    async def sibling(name):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            events.append(f"{name} cancelled")
            await asyncio.sleep(0.02)  # cleanup that must finish before the error propagates
            events.append(f"{name} drained")
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise KeyError("missing field")

    with pytest.raises(KeyError, match="missing field"):
        await gather_cancel_siblings(sibling("s1"), failing(), sibling("s2"))
    assert sorted(events) == ["s1 cancelled", "s1 drained", "s2 cancelled", "s2 drained"]


async def test_gather_propagates_a_typed_failure_unwrapped():
    async def fail():
        raise GenerationUnavailable("shard 2 died")

    with pytest.raises(GenerationUnavailable, match="shard 2 died") as info:
        await gather_cancel_siblings(fail(), asyncio.sleep(60))
    assert not isinstance(info.value, BaseExceptionGroup)


async def test_cancelling_the_caller_cancels_every_child():
    cancelled: list[int] = []
    started = asyncio.Event()

    async def child(i):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    outer = asyncio.create_task(gather_cancel_siblings(child(0), child(1), child(2)))
    await started.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert sorted(cancelled) == [0, 1, 2]


async def test_gather_rejects_non_awaitables_without_leaking_coroutines():
    async def never():
        return 1

    coro = never()
    with pytest.raises(TypeError, match="int"):
        await gather_cancel_siblings(coro, 3)  # type: ignore[arg-type]
    assert coro.cr_frame is None  # closed, so no "never awaited" warning


# Modules that are a subprocess's entry point (importing them starts nothing, but they are not library code).
_ENTRY_POINTS = {"gym_bridge.gym.servers._forkserver", "gym_bridge.gym.servers._launcher", "gym_bridge.gym.servers._server_preload"}


def test_every_exception_class_of_the_package_derives_from_gym_bridge_error():
    import ast
    import importlib
    import pkgutil
    from pathlib import Path

    from gym_bridge.failures import GymBridgeError

    found = []
    for info in pkgutil.walk_packages(gym_bridge.__path__, "gym_bridge."):
        if info.name in _ENTRY_POINTS:
            source = Path(importlib.util.find_spec(info.name).origin).read_text()
            bases = [ast.unparse(b) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) for b in n.bases]
            assert not [b for b in bases if "Error" in b or "Exception" in b], info.name
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            # Exception, not BaseException: EvalInterrupted is a KeyboardInterrupt, which no handler of ours may swallow
            if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == info.name:
                found.append(value)
    assert len(found) >= 35
    strays = [f"{cls.__module__}.{cls.__qualname__}" for cls in found if not issubclass(cls, GymBridgeError)]
    assert strays == []
