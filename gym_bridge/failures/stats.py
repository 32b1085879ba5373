"""Run-wide rollout counters, exported under NeMo-RL's ``rollout/*`` metric names."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RolloutStats"]


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

    def record_redispatch(self, reason: str) -> None:
        _bump(self.redispatches_by_reason, reason)

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
            "rollout/infra_drops_total": float(sum(self.infra_drops_by_reason.values())),
            "rollout/max_consecutive_infra_drops": float(self.max_consecutive_infra_drops),
        }
        for prefix, counter in (
            ("rollout/redispatch_total", self.redispatches_by_reason),
            ("rollout/data_retry_total", self.data_retries_by_reason),
            ("rollout/data_failures_total", self.data_failures_by_reason),
            ("rollout/infra_drops_total", self.infra_drops_by_reason),
        ):
            metrics.update({f"{prefix}/{reason}": float(n) for reason, n in sorted(counter.items())})
        return metrics
