"""Every exception a rollout, a Gym server set or a generation engine raises (the tree is drawn in
:mod:`gym_bridge.failures`). Each takes a single message string, so it pickles across Ray."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "EndpointConfigError",
    "EndpointUnavailable",
    "EngineShutDownError",
    "EnvironmentUnavailable",
    "GenerationUnavailable",
    "GymBridgeError",
    "GymMetricsError",
    "GymPortInUse",
    "GymResultError",
    "GymRowIndexError",
    "GymRunError",
    "GymServerCrashLoop",
    "GymServerDied",
    "GymServerRestarting",
    "GymServersError",
    "GymStartupError",
    "GymTransportError",
    "InvalidGymRow",
    "MissingGenerationData",
    "NaNLogprobs",
    "NemoGymRestarted",
    "NemoGymServerRestarting",
    "NemoGymUnavailable",
    "NoHealthyShards",
    "RefitMismatch",
    "RolloutDataFailure",
    "RolloutFailure",
    "RolloutInfraFailure",
    "RolloutRedispatchExhausted",
    "RolloutStall",
    "RolloutTimeout",
    "RunConfigurationError",
    "SettingError",
    "StepBatchShortfall",
    "TokenCaptureMasked",
    "TokenDrift",
]


class GymBridgeError(Exception):
    """The root of every exception gym-bridge defines: ``except GymBridgeError`` catches all of ours."""


class SettingError(GymBridgeError, ValueError):
    """A setting, argument or input value the caller gave is invalid; the message names it and what is allowed.

    For checks with no error type of their own closer to the input (``EvalConfigError``, ``TrainingConfigError``).
    A ``ValueError`` too, so callers that catch that keep working."""


class CheckpointError(GymBridgeError, ValueError):
    """A checkpoint file refused before anything in it is used: missing, not a regular file, over its size cap, a
    pickle that names code (only tensors and plain containers load), or not the structure its reader expects.

    Checkpoints come from elsewhere (training folders are passed around), so they are read as untrusted input."""


class RolloutFailure(GymBridgeError):
    """One failed attempt at a prompt."""

    #: The HTTP status an endpoint answered, when one caused it (a proxy hands it on: a 429 stays a 429).
    http_status: int | None = None


# ---- infrastructure: the prompt is fine, the fleet is not --------------------------------------


class RolloutInfraFailure(RolloutFailure):
    """The prompt is fine; the infrastructure serving it is not."""


class RolloutTimeout(RolloutInfraFailure):
    """A rollout deadline expired."""


class GenerationUnavailable(RolloutInfraFailure):
    """A generation worker could not serve the request (dead, unreachable, out of memory)."""


class EndpointUnavailable(GenerationUnavailable):
    """A model endpoint stopped accepting connections while rows were in flight (named, with for how long)."""


class NoHealthyShards(RolloutInfraFailure):
    """No generation shard is eligible: every endpoint is cooling down after refusing connections."""


class EnvironmentUnavailable(RolloutInfraFailure):
    """An environment actor died or could not be reached."""


class NemoGymUnavailable(EnvironmentUnavailable):
    """The actor has no running Gym servers: never spun up, shut down, or a server died (named)."""


class NemoGymServerRestarting(NemoGymUnavailable):
    """A Gym server of the actor's set exited while rows were in flight and is being started again: the rows are
    re-sent once it answers (counted as re-dispatches of this reason)."""


class NemoGymRestarted(NemoGymUnavailable):
    """Ray restarted the actor, so its Gym servers are gone; ``on_restart="fail"`` asks for a new spinup()."""


class GymTransportError(RolloutInfraFailure):
    """NeMo-Gym's /run failed in transport: an infra HTTP status or a broken stream."""


class GymRowIndexError(GymTransportError):
    """The actor streamed back a row index that is not an int, out of range, not dispatched, or repeated."""


# ---- data: this prompt fails deterministically ---------------------------------------------


class RolloutDataFailure(RolloutFailure):
    """A deterministic, prompt-specific failure."""


class EndpointConfigError(RolloutDataFailure):
    """The model endpoint refused the request with a 4xx (wrong model, rejected tools, bad request).

    A configuration problem, not the fleet's: never re-dispatched. The single message
    reads ``model endpoint answered HTTP <status>: <message> | via <server path> | <where>``;
    :attr:`status`, :attr:`detail` and :attr:`path` read it back (so it pickles as one string).
    """

    _PREFIX = "model endpoint answered HTTP "

    @classmethod
    def build(cls, status: int, detail: str, path: str, where: str) -> EndpointConfigError:
        return cls(f"{cls._PREFIX}{status}: {detail} | via {path} | {where}")

    def _parts(self) -> list[str]:
        return str(self).removeprefix(self._PREFIX).rsplit(" | ", 2)

    @property
    def status(self) -> int | None:
        head = self._parts()[0].split(":", 1)[0]
        return int(head) if head.isdigit() else None

    @property
    def detail(self) -> str:
        return self._parts()[0].split(": ", 1)[-1]

    @property
    def path(self) -> str:
        parts = self._parts()
        return parts[1].removeprefix("via ") if len(parts) == 3 else ""

    @property
    def summary(self) -> str:
        """The status and the endpoint's message, without the row: equal for every row the same problem hits."""
        return f"HTTP {self.status}: {self.detail}"


class InvalidGymRow(RolloutDataFailure):
    """A Gym row that cannot be dispatched; the message names the prompt, the field and the reason."""


class GymRunError(RolloutDataFailure):
    """Gym's ``agent_run_error`` (or another data ``_ng_failure_class``): the row's ``/run`` failed in Gym's own server
    code (the agent, its environment server or a resources server raised), deterministic for this row: never
    re-sent as infrastructure. The message names the class, the exception and the servers it came through."""


class GymResultError(RolloutDataFailure):
    """A NeMo-Gym result cannot be turned into a message log."""


class MissingGenerationData(GymResultError):
    """No model call of the result carried token ids."""


class NaNLogprobs(GymResultError):
    """A model call's generation logprobs contain NaN."""


class TokenDrift(GymResultError):
    """A turn's prompt tokens do not start with the token history of the earlier turns."""


# ---- terminal for the run: deliberately not RolloutFailure, so per-attempt handlers miss them ---


class RolloutRedispatchExhausted(GymBridgeError, RuntimeError):
    """Terminal: too many prompts in a row spent their infrastructure retry budget."""


class RolloutStall(GymBridgeError, RuntimeError):
    """Terminal: rollouts were in flight but none committed within the stall deadline."""


class StepBatchShortfall(GymBridgeError, RuntimeError):
    """Terminal: a training step kept fewer prompt groups than ``min_step_batch_fraction`` allows."""


class RefitMismatch(GymBridgeError, RuntimeError):
    """Terminal: after a refit the engine does not hold the trained weights (wrong version or fingerprint)."""


class RunConfigurationError(GymBridgeError, RuntimeError):
    """Terminal: the first groups of the run all failed with the same configuration error (the message says which)."""


class TokenCaptureMasked(RunConfigurationError):
    """Terminal: more of the run's finalised token captures came back masked than ``token_id_capture.max_mask_fraction``
    allows (after ``mask_fraction_min_samples``): Gym 0.7's abort, with Gym's message."""


# ---- outside a rollout attempt: Gym's server set and the local generation engine ----------------


class GymServersError(GymBridgeError, RuntimeError):
    """A NeMo-Gym server set failed."""


class GymStartupError(GymServersError):
    """A server died during start-up, or was not answering when the deadline expired."""


class GymPortInUse(GymStartupError):
    """A server could not bind its port: another process took it between Gym choosing it and the server binding it
    (or a configured port is busy). The message names the server, the address and the log."""


class GymServerDied(GymServersError):
    """A server of a started ``GymServers`` is no longer running."""


class GymServerRestarting(GymServerDied):
    """A server of a started set exited and is being started again (or is not answering yet since): rows in flight
    are lost to it and re-sent; the message names the server, its restart count and its log."""


class GymServerCrashLoop(GymServerDied):
    """A server exited once more after its last allowed restart: the run stops, naming the server and its log
    (``--resume`` continues it from its last checkpoint or result)."""


class GymMetricsError(GymServersError):
    """A Gym server's ``/aggregate_metrics`` did not answer in time or answered other than Gym's metrics (the server
    and the reason named): the eval-run files are left without the aggregate-metrics file."""


class EngineShutDownError(GymBridgeError, RuntimeError):
    """The generation engine was shut down before (or while) this request ran."""
