"""How things fail: every exception class, failure classification, retries, deadlines, counters.

The whole exception tree (all defined in :mod:`gym_bridge.failures.errors`)::

    GymBridgeError                    the root of every exception gym-bridge defines
     ├── SettingError                 an invalid setting, argument or input value (also a ValueError)
     ├── CheckpointError              a checkpoint file refused: pickled code, not a regular file, too large,
     │                                or not the expected structure (also a ValueError)
     ├── RolloutFailure               one attempt at a prompt failed; the retry policy decides
     │    ├── RolloutInfraFailure     the prompt is fine, the fleet is not: retry, maybe elsewhere
     │    │    ├── RolloutTimeout     a deadline expired (generation turn, environment step,
     │    │    │                      NeMo-Gym prompt group, one /run call)
     │    │    ├── GenerationUnavailable  a generation worker or HTTP endpoint could not serve the request
     │    │    │    └── EndpointUnavailable  a model endpoint stopped accepting connections mid-run (named)
     │    │    ├── NoHealthyShards    every generation endpoint is cooling down after refusing connections
     │    │    ├── EnvironmentUnavailable  an environment actor died or is unreachable
     │    │    │    └── NemoGymUnavailable  the NemoGym actor has no running Gym servers (a dead one is named)
     │    │    │         └── NemoGymRestarted  Ray restarted the actor; on_restart="fail" asks for spinup()
     │    │    └── GymTransportError  NeMo-Gym /run failed in transport (HTTP 5xx/408/429, broken stream)
     │    │         └── GymRowIndexError  the stream returned a bad, repeated or never-sent row index
     │    └── RolloutDataFailure      deterministic and prompt-specific: retrying will not help
     │         ├── EndpointConfigError  the model endpoint answered 4xx: wrong model, tools refused, bad
     │         │                      request (status, endpoint message, Gym server path)
     │         ├── InvalidGymRow      a row that cannot be dispatched (names prompt, field, reason)
     │         ├── GymRunError        Gym's agent_run_error: the row's /run failed in Gym's own server code
     │         │                      (agent, environment or resources server raised): not re-sent
     │         └── GymResultError     a Gym /run result cannot become a message log
     │              ├── MissingGenerationData  no model call carried token ids
     │              ├── NaNLogprobs   a generation logprob is NaN
     │              └── TokenDrift    a turn's prompt does not extend the token history
     │
     │   also RuntimeError, terminal for the run or outside a rollout attempt:
     ├── RolloutRedispatchExhausted   too many prompts dropped in a row
     ├── RolloutStall                 rollouts in flight, none committed within the stall deadline
     ├── RefitMismatch                the engine does not hold the weights just trained (version or fingerprint)
     ├── StepBatchShortfall           a step kept fewer groups than min_step_batch_fraction
     ├── RunConfigurationError        the run's first groups all hit one configuration error
     │    └── TokenCaptureMasked      more finalised token captures masked than token_id_capture.max_mask_fraction
     ├── GymServersError              a Gym server set failed (gym/servers/server_set.py)
     │    ├── GymStartupError         a server died during start-up or did not answer in time
     │    │    └── GymPortInUse       a server's port was taken before it bound it (named)
     │    └── GymServerDied           a server of a started set is no longer running
     └── EngineShutDownError          the local generation engine was shut down (generation/hf.py)

Errors that are never a rollout attempt's outcome (bad input, a misused object, a process that would not
start) subclass ``GymBridgeError`` too but stay beside the code that checks for them; most also subclass the
builtin a caller would expect (``ValueError``, ``RuntimeError``, ``OSError``, ...)::

    batched                BatchShapeError
    config.training        TrainingConfigError
    environments.rewards   RewardTimeout, NonFiniteScore
    eval                   EvalConfigError, DatasetError, RunDirError, RunReadError, CompareError, RescoreError
    generation.openai_http BlockingCallInEventLoop
    gym                    UnsupportedGymVersion, GymConfigNotFound
    gym_model              TranslationError, CompletionsError, ClientNotStarted, GymModelConfigError
    models                 ModelNotFoundError, ModelLoadError, ModelCacheError, SmolLM2Unavailable
    policy.hf              ReferenceModelMissing
    preflight              PreflightError
    rollout                BackendNotFoundError, BackendLoadError, BackendContractError, UnknownTaskError,
                           EnvironmentReturnError, EmptyRolloutStream, SlotError
    serving                ServingError (an HTTP answer of our server), IncompleteGeneration, ServerBindError,
                           ServerStartError, ServerStateError, UpstreamError
    testing                LocalClusterError, ServiceProcessError

``SettingError`` (above) is the one for an invalid setting or argument with no type closer to its input.
``gym-bridge``'s ``main()`` prints any of them as one line, exit code 2.
``tests/test_failures.py`` checks that every exception class of the package derives from ``GymBridgeError``.

Every class takes a single message string, so it pickles across Ray; the ``__cause__``
chain does not survive pickling, so the message carries what matters.

Modules: :mod:`~gym_bridge.failures.errors` (the classes),
:mod:`~gym_bridge.failures.classify` (INFRA or DATA, typed failures from raw errors),
:mod:`~gym_bridge.failures.retry` (retry policy, timeouts, ``deadline``, backoff,
``gather_cancel_siblings``), :mod:`~gym_bridge.failures.stats` (run-wide counters and the
stop-at-once rule), :mod:`~gym_bridge.failures.gym_chain` (Gym's nested error bodies unwrapped).
Nothing here imports Ray, torch or an HTTP library.
"""

from gym_bridge.failures import errors
from gym_bridge.failures.classify import (
    FailureClass,
    classify_environment_failure,
    classify_generation_failure,
    classify_rollout_failure,
    gym_failure_kind_class,
    gym_status_failure,
    http_status_is_infra,
    shorten,
    typed_gym_failure,
)
from gym_bridge.failures.errors import *  # noqa: F403  (the classes; errors.__all__ is their one list)
from gym_bridge.failures.gym_chain import (
    GymErrorChain,
    gym_run_failure,
    unwrap_gym_error,
)
from gym_bridge.failures.retry import (
    RolloutRetryPolicy,
    RolloutTimeouts,
    backoff_delay,
    deadline,
    gather_cancel_siblings,
)
from gym_bridge.failures.stats import ConfigFailureWatch, RolloutStats

__all__ = [
    *errors.__all__,
    "ConfigFailureWatch",
    "FailureClass",
    "GymErrorChain",
    "RolloutRetryPolicy",
    "RolloutStats",
    "RolloutTimeouts",
    "backoff_delay",
    "classify_environment_failure",
    "classify_generation_failure",
    "classify_rollout_failure",
    "deadline",
    "gather_cancel_siblings",
    "gym_failure_kind_class",
    "gym_run_failure",
    "gym_status_failure",
    "http_status_is_infra",
    "shorten",
    "typed_gym_failure",
    "unwrap_gym_error",
]
