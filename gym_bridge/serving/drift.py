"""Drift accounting: what the on-policy token-id correction saved, per request and in total.

Every chat completion is recorded once (:meth:`DriftCounter.record`): whether it
carried earlier turns' token ids, whether the splice was applied, and whether the
plain re-tokenised render differs from the carried-ids prompt (it *drifted*). With
the correction on, a drift is one the correction prevented; with it off (a server
behaving like stock vLLM), a drift is one that was served. Upstream errors are
counted by HTTP status.

The counts are served as Prometheus text (``GET /metrics``) and the per-request
facts as response headers (:data:`HEADER_CORRECTION`, :data:`HEADER_DRIFT`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from gym_bridge.serving.chat import ChatPrompt

#: ``applied`` (carried ids spliced), ``disabled`` (carried ids ignored) or ``none`` (nothing carried).
HEADER_CORRECTION = "x-gym-bridge-token-correction"
#: The first drifting token position of the plain render, or ``none``.
HEADER_DRIFT = "x-gym-bridge-token-drift"

_PREFIX = "gym_bridge"


@dataclass
class DriftCounter:
    """Thread-safe counters of chat requests, corrections, drifts and upstream errors."""

    chat_requests: int = 0
    carried: int = 0
    corrected: int = 0
    drift_prevented: int = 0
    drift_served: int = 0
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[int] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, prompt: ChatPrompt) -> dict[str, str]:
        """Count one chat completion's prompt; return its response headers."""
        drifted = prompt.drift_at is not None
        with self._lock:
            self.chat_requests += 1
            self.carried += prompt.carried
            self.corrected += prompt.spliced
            self.drift_prevented += drifted and prompt.spliced
            self.drift_served += drifted and not prompt.spliced
        state = "applied" if prompt.spliced else "disabled" if prompt.carried else "none"
        return {HEADER_CORRECTION: state, HEADER_DRIFT: "none" if not drifted else str(prompt.drift_at)}

    def count_request(self, endpoint: str) -> None:
        with self._lock:
            self.requests[endpoint] += 1

    def count_error(self, status: int) -> None:
        with self._lock:
            self.errors[status] += 1

    def prometheus_text(self) -> str:
        """The counters in Prometheus text exposition format (version 0.0.4)."""
        with self._lock:
            scalars = [
                ("chat_requests_total", "Chat completion requests rendered.", self.chat_requests),
                ("token_ids_carried_total", "Chat requests carrying earlier turns' token ids.", self.carried),
                ("token_corrections_total", "Chat requests whose prompt was spliced from carried ids.", self.corrected),
                (
                    "token_drift_prevented_total",
                    "Corrected requests whose plain re-tokenised render would have drifted.",
                    self.drift_prevented,
                ),
                (
                    "token_drift_served_total",
                    "Uncorrected requests (correction disabled) served a drifted render.",
                    self.drift_served,
                ),
            ]
            requests = sorted(self.requests.items())
            errors = sorted(self.errors.items())
        lines = []
        for name, help_text, value in scalars:
            lines += [f"# HELP {_PREFIX}_{name} {help_text}", f"# TYPE {_PREFIX}_{name} counter"]
            lines.append(f"{_PREFIX}_{name} {value}")
        lines += [f"# HELP {_PREFIX}_requests_total Requests by endpoint.", f"# TYPE {_PREFIX}_requests_total counter"]
        lines += [f'{_PREFIX}_requests_total{{endpoint="{ep}"}} {n}' for ep, n in requests]
        lines += [
            f"# HELP {_PREFIX}_upstream_errors_total Generation failures handed to clients, by HTTP status.",
            f"# TYPE {_PREFIX}_upstream_errors_total counter",
        ]
        lines += [f'{_PREFIX}_upstream_errors_total{{status="{s}"}} {n}' for s, n in errors]
        return "\n".join(lines) + "\n"
