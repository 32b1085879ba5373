"""``GET /metrics``: the server's counters in Prometheus text format (version 0.0.4).

The drift and request counters (:class:`~gym_bridge.serving.drift.DriftCounter`); vLLM's request gauges
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (an engine that counts its rows, such as
:class:`~gym_bridge.generation.hf.HFGeneration`, gives both; for any other engine every row the server is
generating counts as running and none as waiting); and, for an engine that keeps a prefix cache, its counters
under vLLM's names and semantics: ``vllm:prefix_cache_queries`` (prompt tokens looked up) and
``vllm:prefix_cache_hits`` (prompt tokens found), which prometheus_client exposes with the ``_total`` suffix.
Every vLLM series carries the ``model_name`` and ``engine`` labels, as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from fastapi import Request
from fastapi.responses import PlainTextResponse

from gym_bridge.serving.state import ServingState, serving_state


class PrefixCacheTokens(Protocol):
    """Prompt tokens queried and hit, as an engine counts them."""

    @property
    def queries(self) -> int: ...

    @property
    def hits(self) -> int: ...


@runtime_checkable
class PrefixCacheReporter(Protocol):
    """An engine that keeps a prefix cache and counts its lookups since it started."""

    def prefix_cache_counts(self) -> PrefixCacheTokens: ...


class RequestCounts(Protocol):
    """Requests (rows) an engine is decoding, and those queued for a place in its batch."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...


@runtime_checkable
class RequestCountsReporter(Protocol):
    """An engine that counts its rows in flight (cheap, callable from the event loop)."""

    def request_counts(self) -> RequestCounts: ...


_REQUEST_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
)

_PREFIX_CACHE_METRICS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "hits"),
)


def prometheus_text(state: ServingState) -> str:
    """Every counter the server exposes, in Prometheus text format."""
    text = state.drift.prometheus_text()
    generation = state.generation
    labels = f'{{engine="0",model_name="{_label_value(state.served_model_name)}"}}'
    lines = []
    requests: RequestCounts = (
        generation.request_counts()
        if isinstance(generation, RequestCountsReporter)
        else ServerRows(running=state.rows_generating, waiting=0)
    )
    for name, help_text, field in _REQUEST_GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{labels} {getattr(requests, field)}"]
    if isinstance(generation, PrefixCacheReporter):
        counts = generation.prefix_cache_counts()
        for name, help_text, field in _PREFIX_CACHE_METRICS:
            lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
            lines.append(f"{name}_total{labels} {getattr(counts, field)}")
    return text + "\n".join(lines) + "\n"


async def metrics(request: Request) -> PlainTextResponse:
    """``GET /metrics``: the drift, request and prefix-cache counters in Prometheus text format."""
    return PlainTextResponse(prometheus_text(serving_state(request)), media_type="text/plain; version=0.0.4")


@dataclass(frozen=True)
class ServerRows:
    """The server's own count of rows it is generating, for an engine that does not count them."""

    running: int
    waiting: int


def _label_value(value: str) -> str:
    """``value`` escaped for a Prometheus label: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
