"""Everything that differs between the NeMo-Gym versions gym-bridge supports, in one place.

The installed version is read from package metadata, so the driver never imports ``nemo_gym``
(seconds) to learn it. Every other module reads the fields of :func:`installed_gym`'s
:class:`GymVersion`; nothing else compares version numbers. Each field names the release that
changed it, read from the wheels of 0.4.0, 0.5.1, 0.6.0 and 0.7.0 (docs/nemo_gym.md: versions).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, field

from packaging.version import Version

from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject

SUPPORTED_GYM = (Version("0.4.0"), Version("0.8.0"))
"""The supported range, lower bound included: what ``pyproject.toml`` admits."""

_BASE_SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")

# NeMoGymResponseCreateParamsNonStreaming's fields; the model forbids any other key (a 422 from /run).
_REQUEST_FIELDS_0_4 = frozenset(
    {
        "background",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "metadata",
        "model",
        "parallel_tool_calls",
        "previous_response_id",
        "prompt",
        "reasoning",
        "service_tier",
        "store",
        "stream",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "truncation",
        "user",
    }
)
_REQUEST_FIELDS_0_6 = _REQUEST_FIELDS_0_4 | {
    "context_management",
    "conversation",
    "moderation",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "stream_options",
}


TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
ATTEMPT_INDEX_KEY = "_ng_attempt_index"
ROLLOUT_ID_KEY = "_ng_rollout_id"
ROLLOUT_IDENTITY_KEYS = (TASK_INDEX_KEY, ROLLOUT_INDEX_KEY, ATTEMPT_INDEX_KEY, ROLLOUT_ID_KEY)

_RATE_LIMIT_STATUSES = frozenset({429, 502, 503, 504, 520})


class UnsupportedGymVersion(GymBridgeError, RuntimeError):
    """The installed nemo-gym is outside :data:`SUPPORTED_GYM`, or not installed."""


@dataclass(frozen=True)
class EvalRunFiles:
    """What Gym's own eval collection writes beside its rollouts file, so gym-bridge's eval writes the same."""

    aggregate_metrics: bool
    """``<stem>_aggregate_metrics.json``: one entry per scoring server, from that server's ``/aggregate_metrics``
    (0.4 and 0.5: each agent's, which asks its resources server; 0.7: each environment server's)."""
    stamps_environment_server: bool
    """0.7: every record and every metrics entry names the environment server that ran it (``_ng_environment_server``,
    and ``_ng_result_type`` its implementation); metrics are asked of that server (a relay forwards to its agent)."""
    tools: tuple[str, ...]
    """Gym's commands that read such a folder: 0.4 ``aggregate`` and ``profile``, 0.5 adds ``reverify``, 0.7
    ``compare``, ``health-check`` and ``export`` (read from each wheel's ``cli/main.py``)."""


@dataclass(frozen=True)
class GymVersion:
    """How one NeMo-Gym release starts its servers, what its rows and results hold.

    Two differences need no field: the launcher's ``run_command`` stand-in takes every version's signature
    (0.6 adds keyword-only output targets, 0.7 ``extra_env`` carrying ``NEMO_GYM_CONFIG_*``), the fork server
    matches both command shapes; and the result flags of 0.7 (``mask_sample``, ``failure_kind``) are read
    wherever present (older Gyms send ``instance_config.mask_sample`` only).
    """

    version: Version
    server_types: tuple[str, ...]
    """The ``<type>`` folders a server lives in; 0.6 adds ``environment_servers``."""
    relays_per_agent: bool
    """0.6: Gym starts an ``environment_servers/legacy_agent`` relay for every agent that has no environment
    server (a 5-server set becomes 7). The relay forwards ``/run`` unchanged; we dispatch to the agent itself."""
    request_fields: frozenset[str]
    """The keys ``responses_create_params`` may hold; 0.6 adds seven."""
    model_client_retry_statuses: frozenset[int]
    """The endpoint statuses Gym's model client (``vllm_model`` -> the policy endpoint) retries, 3 tries in all;
    0.7 adds 404 and 408, so a wrong model name reaches the endpoint three times per call before it fails."""
    rate_limits_retried_forever: bool
    """Up to 0.6 every 429/502/503/504/520 adds a try, so a persistent one ends only at our deadline
    (``RolloutTimeout``); 0.7 extends tries only between Gym's own servers, so it fails after 3 tries."""
    converter_flushes_per_turn: bool
    """0.6: ``vllm_model``'s Responses -> chat converter gives an assistant turn only its own token ids (before,
    the last ids seen rode on every later assistant message), flushes a buffered assistant item even when it is
    empty, and leaves ``tool_calls`` out when there are none (before: ``tool_calls: []``)."""
    output_item_null_fields: dict[str, tuple[str, ...]]
    """0.7: output items carry more fields, null from ``vllm_model``: ``reasoning.content``, ``message.phase``,
    ``function_call.namespace`` (by item type)."""
    response_status: bool
    """0.6: ``vllm_model``'s response has ``status`` ``"completed"`` or ``"incomplete"`` (before: null)."""
    usage_details_unknown: bool
    """0.7: ``usage``'s ``cached_tokens`` and ``reasoning_tokens`` are null when the endpoint does not report them
    (before: 0)."""
    response_null_fields: tuple[str, ...]
    """0.7: ``NeMoGymResponse`` adds ``completed_at``, ``moderation`` and ``prompt_cache_retention`` (null)."""
    task_source_routing: bool
    """0.6: rows may name the config instance that declared their dataset (``task_source``) instead of an agent;
    the launcher resolves each with Gym's own ``RolloutCollectionHelper.resolve_task_sources``."""
    rollout_identity_keys: tuple[str, ...]
    """The ``_ng_*`` keys Gym's collection stamps on each rollout and reads back: task and rollout index on every
    version, ``_ng_attempt_index`` from 0.5, ``_ng_rollout_id`` (the token-capture key) from 0.7."""
    token_id_capture: bool
    """0.7: Gym's model server records token ids under a rollout's capture key (``token_id_capture``), for agents
    whose responses carry none; the NemoGym actor finalises them (:mod:`gym_bridge.gym.protocol.token_capture`)."""
    cancels_on_disconnect: bool
    """0.7: every Gym server cancels a request whose client disconnects (``ClientDisconnectCancellationMiddleware``),
    so a ``/run`` the actor gives up on stops down to the model endpoint; 0.4.0 and 0.5.1 have no such middleware
    (their agents run an abandoned row to its end)."""
    episode_protocol: bool
    """0.7: Gym's episode protocol for materialized rows (``task_id`` = ``{taskset, task_id}`` plus ``task_input``):
    each is sent as an episode request (``{episode_id, task}``) to the environment server its taskset names in
    ``environment_server_routes``, and the ``{result | failure}`` reply becomes the rollout record
    (``rollout_collection._episode_request_body`` / ``_episode_record``). Before, such rows are refused."""
    head_readiness_path: str
    """The head server's readiness route: ``/readyz`` (0.7, 200 once every server and endpoint answered) or ``/``."""
    eval_run_files: EvalRunFiles
    """What Gym's eval collection writes beside its rollouts (:mod:`gym_bridge.gym.protocol.eval_run`)."""
    global_config: JsonObject = field(default_factory=dict)
    """Keys set on every server set: Gym's own wait for the model endpoints is off, since preflight checks them
    and every rollout call has its own deadline (0.5 waits up to 600 s by default)."""

    @property
    def label(self) -> str:
        return f"nemo-gym {self.version}"


def gym_version(version: str | Version) -> GymVersion:
    """The profile of a NeMo-Gym release; :class:`UnsupportedGymVersion` outside :data:`SUPPORTED_GYM`."""
    v = Version(str(version))
    low, high = SUPPORTED_GYM
    if not low <= v < high:
        raise UnsupportedGymVersion(f"nemo-gym {v} is not supported: gym-bridge supports >={low},<{high}")

    def at_least(release: str) -> bool:
        return v >= Version(release)

    return GymVersion(
        version=v,
        server_types=_BASE_SERVER_TYPES + (("environment_servers",) if at_least("0.6") else ()),
        relays_per_agent=at_least("0.6"),
        request_fields=_REQUEST_FIELDS_0_6 if at_least("0.6") else _REQUEST_FIELDS_0_4,
        model_client_retry_statuses=_RATE_LIMIT_STATUSES | ({404, 408, 500} if at_least("0.7") else {500}),
        rate_limits_retried_forever=not at_least("0.7"),
        converter_flushes_per_turn=at_least("0.6"),
        output_item_null_fields=(
            {"reasoning": ("content",), "message": ("phase",), "function_call": ("namespace",)}
            if at_least("0.7")
            else {}
        ),
        response_status=at_least("0.6"),
        usage_details_unknown=at_least("0.7"),
        response_null_fields=("completed_at", "moderation", "prompt_cache_retention") if at_least("0.7") else (),
        task_source_routing=at_least("0.6"),
        rollout_identity_keys=(
            (TASK_INDEX_KEY, ROLLOUT_INDEX_KEY)
            + ((ATTEMPT_INDEX_KEY,) if at_least("0.5") else ())
            + ((ROLLOUT_ID_KEY,) if at_least("0.7") else ())
        ),
        token_id_capture=at_least("0.7"),
        cancels_on_disconnect=at_least("0.7"),
        episode_protocol=at_least("0.7"),
        head_readiness_path="/readyz" if at_least("0.7") else "/",
        eval_run_files=_eval_run_files(v),
        global_config={"model_endpoint_readiness_timeout_seconds": 0} if at_least("0.5") else {},
    )


def _eval_run_files(v: Version) -> EvalRunFiles:
    if v >= Version("0.7"):
        return EvalRunFiles(
            aggregate_metrics=True,
            stamps_environment_server=True,
            tools=("gym eval compare", "gym eval aggregate", "gym eval health-check", "gym eval profile",
                   "gym eval export", "gym eval reverify"),
        )  # fmt: skip
    tools = ("gym eval aggregate", "gym eval profile") + (("gym eval reverify",) if v >= Version("0.5") else ())
    return EvalRunFiles(aggregate_metrics=True, stamps_environment_server=False, tools=tools)


@functools.cache
def installed_gym() -> GymVersion:
    """The profile of the installed nemo-gym, read from its package metadata (no import of ``nemo_gym``)."""
    try:
        version = importlib.metadata.version("nemo-gym")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedGymVersion("nemo-gym is not installed") from None
    return gym_version(version)
