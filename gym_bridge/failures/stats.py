"""Run-wide rollout counters (NeMo-RL's ``rollout/*`` metric names) and the stop-at-once rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_bridge.failures.errors import EndpointConfigError, RunConfigurationError


def _bump(counter: dict[str, int], reason: str, by: int = 1) -> None:
    counter[reason] = counter.get(reason, 0) + by


@dataclass
class RolloutStats:
    """Run-wide rollout counters; reasons are exception class names."""

    committed: int = 0
    skipped: int = 0
    redispatches_by_reason: dict[str, int] = field(default_factory=dict)
    data_retries_by_reason: dict[str, int] = field(default_factory=dict)
    data_failures_by_reason: dict[str, int] = field(default_factory=dict)
    infra_drops_by_reason: dict[str, int] = field(default_factory=dict)
    max_consecutive_infra_drops: int = 0
    gym_row_redispatches: int = 0
    env_failure_redispatches_by_kind: dict[str, int] = field(default_factory=dict)
    """Rows Gym returned masked with an infrastructure ``failure_kind``, re-sent (by kind)."""
    saturation_timeouts_by_reason: dict[str, int] = field(default_factory=dict)
    """Timeouts judged a saturated engine (``endpoint_queue`` or ``latency``), whether or not they halved the limit."""
    admission_backoffs: int = 0
    """Halvings of the limit on Gym rows in flight (one per saturation)."""
    admission_backoff_s: float = 0.0
    """Seconds of admission pause those back-offs asked for."""
    admission_limit: int | None = None
    """The limit on Gym rows in flight now; None while there is none."""
    admission_lowest_limit: int | None = None
    """The lowest that limit went; None while it never was set."""
    admission_drains: int = 0
    """Waits, after a back-off, for the endpoint to drain the work of the rows given up on."""
    admission_drain_s: float = 0.0
    """Seconds admission held for those waits."""
    admission_drain_timeouts: int = 0
    """Of those waits, the ones that ended at their bound with the endpoint still busy."""

    def record_redispatch(self, reason: str) -> None:
        _bump(self.redispatches_by_reason, reason)

    def record_gym_row_redispatch(self, rows: int = 1) -> None:
        """``rows`` rows of one group re-sent to Gym after an infrastructure failure (NeMo-RL's signature)."""
        self.gym_row_redispatches += rows

    def record_env_failure_redispatch(self, failure_kind: str) -> None:
        _bump(self.env_failure_redispatches_by_kind, failure_kind)

    def record_saturation_timeout(self, reason: str, pause_s: float | None) -> None:
        """A timeout judged a saturated engine; ``pause_s`` when it backed off (halved the limit and paused)."""
        _bump(self.saturation_timeouts_by_reason, reason)
        if pause_s is not None:
            self.admission_backoffs += 1
            self.admission_backoff_s += pause_s

    def record_admission_limit(self, limit: int | None) -> None:
        """The limit on Gym rows in flight changed to ``limit`` (None: lifted)."""
        self.admission_limit = limit
        if limit is not None:
            low = self.admission_lowest_limit
            self.admission_lowest_limit = limit if low is None else min(low, limit)

    def record_admission_drain(self, waited_s: float, *, drained: bool) -> None:
        """Admission held ``waited_s`` for the endpoint to drain; ``drained`` False: the wait hit its bound."""
        self.admission_drains += 1
        self.admission_drain_s += waited_s
        self.admission_drain_timeouts += 0 if drained else 1

    def record_data_retry(self, reason: str) -> None:
        _bump(self.data_retries_by_reason, reason)

    def record_data_failure(self, reason: str) -> None:
        _bump(self.data_failures_by_reason, reason)

    def record_infra_drop(self, reason: str, consecutive: int) -> None:
        _bump(self.infra_drops_by_reason, reason)
        self.max_consecutive_infra_drops = max(self.max_consecutive_infra_drops, consecutive)

    def as_metrics(self) -> dict[str, float]:
        """NeMo-RL's ``rollout/*`` metric names, all floats."""
        metrics = {
            "rollout/committed_total": float(self.committed),
            "rollout/skipped_total": float(self.skipped),
            "rollout/redispatch_total": float(sum(self.redispatches_by_reason.values())),
            "rollout/data_retry_total": float(sum(self.data_retries_by_reason.values())),
            "rollout/data_failures_total": float(sum(self.data_failures_by_reason.values())),
            "rollout/gym_row_redispatch_total": float(self.gym_row_redispatches),
            "rollout/env_failure_redispatch_total": float(sum(self.env_failure_redispatches_by_kind.values())),
            "rollout/infra_drops_total": float(sum(self.infra_drops_by_reason.values())),
            "rollout/max_consecutive_infra_drops": float(self.max_consecutive_infra_drops),
            "rollout/saturation_timeout_total": float(sum(self.saturation_timeouts_by_reason.values())),
            "rollout/admission_backoff_total": float(self.admission_backoffs),
            "rollout/admission_backoff_s": float(self.admission_backoff_s),
            "rollout/admission_drain_total": float(self.admission_drains),
            "rollout/admission_drain_s": float(self.admission_drain_s),
            "rollout/admission_drain_timeout_total": float(self.admission_drain_timeouts),
        }
        if self.admission_limit is not None:
            metrics["rollout/admission_limit"] = float(self.admission_limit)
        if self.admission_lowest_limit is not None:
            metrics["rollout/admission_lowest_limit"] = float(self.admission_lowest_limit)
        for prefix, counter in (
            ("rollout/redispatch_total", self.redispatches_by_reason),
            ("rollout/data_retry_total", self.data_retries_by_reason),
            ("rollout/data_failures_total", self.data_failures_by_reason),
            ("rollout/infra_drops_total", self.infra_drops_by_reason),
            ("rollout/env_failure_redispatch_total", self.env_failure_redispatches_by_kind),
            ("rollout/saturation_timeout_total", self.saturation_timeouts_by_reason),
        ):
            metrics.update({f"{prefix}/{reason}": float(n) for reason, n in sorted(counter.items())})
        return metrics


@dataclass
class ConfigFailureWatch:
    """The stop-at-once rule: the run's first ``stop_after`` finished prompts all failing with the
    same :class:`EndpointConfigError` stop the run with :class:`RunConfigurationError`.

    A committed prompt, or one that ended any other way, closes the window for good: after
    a success, a configuration error is one prompt's problem (skipped and counted).
    ``stop_after=0`` turns the rule off.
    """

    stop_after: int = 2
    seen: int = 0
    summary: str | None = None
    closed: bool = False

    def other_outcome(self) -> None:
        """A prompt committed or failed otherwise."""
        self.closed = True

    def config_failure(self, exc: EndpointConfigError) -> None:
        """Count a prompt given up on for ``exc``; raise :class:`RunConfigurationError` when the rule fires."""
        if self.closed or self.stop_after <= 0:
            return
        if self.summary is not None and exc.summary != self.summary:
            self.closed = True
            return
        self.summary = exc.summary
        self.seen += 1
        if self.seen >= self.stop_after:
            raise RunConfigurationError(
                f"stopping the run: its first {self.seen} prompt groups all failed with the same configuration "
                f"error: the {exc.summary.replace('HTTP ', 'model endpoint answered HTTP ', 1)} (via {exc.path}). "
                "Fix the model endpoint or the config; finished results are kept"
            ) from exc
