"""The eval config: a YAML file plus ``key=value`` overrides, validated by pydantic.

Every error names the key it is about. :meth:`EvalConfig.fingerprint` is what a
resumed run must share with the run it continues.

A config names one policy (``base_urls`` / ``model_name`` / ``tokenizer`` / ``api_key_env_var``, or
``embedded_policy``) or several under ``policies:``, each entry a ``name`` plus those keys;
:meth:`EvalConfig.policy_configs` gives one ordinary single-policy config per entry, its run folder
``<output_dir>/<name>``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import read_text
from gym_bridge.boundary.text import shown
from gym_bridge.boundary.yaml_io import MAX_CONFIG_BYTES
from gym_bridge.config.values import (
    INT64_MAX,
    Count,
    FiniteFloat,
    Seconds,
    Seed,
    Temperature,
    TokenCount,
    TopP,
    check_values,
    config_yaml,
    key_parts,
)
from gym_bridge.eval.config_errors import format_errors
from gym_bridge.eval.policy_entry import EmbeddedPolicy, PolicyEntry
from gym_bridge.failures import GymBridgeError, RolloutRetryPolicy
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.transport.admission import AdmissionSettings
from gym_bridge.json_types import JsonMapping, JsonObject

if TYPE_CHECKING:  # torch stays out of the config's imports (the CLI reads configs)
    from gym_bridge.types import GenerationConfig


class EvalConfigError(GymBridgeError, ValueError):
    """The eval config is unreadable or invalid; the message names the key."""


POLICY_KEYS = ("base_urls", "model_name", "tokenizer", "api_key_env_var", "embedded_policy")
"""The keys that name one policy: at the top level (one policy) or in each ``policies`` entry."""
_POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

EVAL_RETRY = RolloutRetryPolicy(
    max_infra_attempts=3,
    max_data_attempts=1,
    max_gym_row_attempts=3,
    max_skipped_prompts=sys.maxsize,
    max_consecutive_dropped_prompts=4,
)
"""The eval's retry policy for the keys ``retry:`` leaves out: a failed group is recorded (``failures.jsonl``,
``--resume`` retries it) and the run goes on, transient infrastructure failures are retried, and the run stops
only when groups keep being dropped for infrastructure."""


class EvalConfig(BaseModel):
    """What ``gym-bridge eval`` runs; see ``docs/evaluation.md`` for every key."""

    model_config = ConfigDict(extra="forbid")

    dataset: Path = Field(description="JSONL file of Gym rows (responses_create_params, agent_ref, verifier fields).")
    config_paths: list[str] = Field(
        default_factory=list,
        description="Gym server configs (absolute, cwd- or wheel-relative); required unless gym_head names a running "
        "Gym, whose config is its own.",
    )
    output_dir: Path = Field(description="Where results.jsonl, failures.jsonl, run.json and the report go.")
    num_generations_per_prompt: Count = 4
    base_urls: list[str] = Field(default_factory=list, description="OpenAI-compatible endpoints; empty: embedded.")
    model_name: str = Field(
        "tiny", description="The served model name Gym sends to the endpoint (default: the embedded model's name)."
    )
    api_key_env_var: str = Field(
        "OPENAI_API_KEY",
        min_length=1,
        description="The environment variable holding the endpoints' API key (unset: none is sent). "
        "The key itself is never a config key: this file is copied into run.json.",
    )
    tokenizer: str = Field(
        "tiny", description='"tiny", "smollm2" or a local tokenizer folder (default: the embedded model\'s).'
    )
    embedded_policy: EmbeddedPolicy = Field(
        "smollm2",
        description="tiny / smollm2: that built-in model served by HFGeneration; scripted: rule-based replies; "
        "a local model folder (a save_pretrained folder, e.g. a gym-bridge train checkpoint): that model.",
    )
    concurrency: Count = Field(4, description="Prompt groups in flight.")
    rollout_timeout_s: Seconds = Field(600.0, description="Deadline of one prompt group, re-dispatches included.")
    request_timeout_s: Seconds = Field(300.0, description="Deadline of one Gym /run call.")
    startup_timeout_s: Seconds = Field(180.0, description="Deadline for Gym's servers to start.")
    preflight_timeout_s: Seconds = Field(20.0, description="Deadline of each endpoint's preflight checks.")
    retry: RolloutRetryPolicy = Field(
        EVAL_RETRY,
        description="The retry policy (RolloutRetryPolicy's keys); a key left out keeps the eval's (EVAL_RETRY).",
    )
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings,
        description="How Gym rows in flight adapt to a saturated endpoint (AdmissionSettings' keys: adaptive, "
        "initial_limit, min_limit, backoff_base_s, max_backoff_s, latency_rise, drain_timeout_s); a key left out "
        "keeps its default.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="The embedded engine's prefix caching (vLLM's enable_prefix_caching): rows reuse the keys and "
        "values of a prompt prefix already computed. An endpoint of base_urls decides its own.",
    )
    temperature: Temperature = Field(1.0, description="0: greedy.")
    top_p: TopP = 1.0
    max_new_tokens: TokenCount = 256
    max_seq_len: TokenCount = 4096
    limit: int | None = Field(None, ge=1, le=INT64_MAX, description="Evaluate only the first `limit` rows.")
    seed: Seed | None = Field(
        0,
        description="The run seed: every row's sampling seed derives from it, the prompt and the sample index, "
        "and goes to the endpoint as its per-request seed (the embedded model's generator too). null: unseeded.",
    )
    pass_threshold: FiniteFloat = Field(1.0, description="A completion passes when its reward >= this.")
    gym_overrides: JsonObject = Field(default_factory=dict, description="Merged into Gym's global config.")
    gym_head: str | None = Field(
        None,
        description="The head server of a NeMo-Gym that is already running (http://host:port, e.g. from `gym env "
        "start`), as `gym eval run --no-serve` takes it: its servers and config are used, none is started or "
        "stopped. base_urls are the endpoints its model server calls (its policy_base_url); config_paths, "
        "gym_overrides and an embedded policy are refused with it.",
    )
    model_server: Literal["vllm_model", "gym_bridge"] = Field(
        "vllm_model",
        description="Gym's model server in front of base_urls: Gym's vllm_model, or gym-bridge's (token-faithful, "
        "one hop, keeps each rollout on one of several base_urls: docs/nemo_gym.md).",
    )
    agent_name: str | None = Field(None, description="Route every row to this agent (Gym's +agent_name).")
    agent_map: dict[str, str] = Field(
        default_factory=dict,
        description="{row agent_ref.name or task_source: agent}, '_default' for every other row (Gym's +agent_map).",
    )
    fan_out: dict[str, list[str]] = Field(
        default_factory=dict,
        description="{row agent_ref.name or task_source: [agents]}: one task per agent (Gym's +fan_out).",
    )
    policies: list[PolicyEntry] | None = Field(
        None,
        description="Several policies in one command: each a name plus the policy keys (base_urls, model_name, "
        "tokenizer, api_key_env_var or embedded_policy); each runs into <output_dir>/<name>, then compare.",
    )
    _policy_configs: list[tuple[str, EvalConfig]] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _finite_and_bounded(cls, data: object) -> object:
        """Every number finite, every integer within 64 bits, nothing nested past ``MAX_CONFIG_DEPTH``, the sections
        pydantic does not type (``gym_overrides``, ``retry``) included: refused naming the key."""
        check_values(data, "")
        return data

    @field_validator("retry", mode="before")
    @classmethod
    def _retry_over_eval_defaults(cls, value: object) -> object:
        """The keys ``retry:`` gives, over :data:`EVAL_RETRY` (not over the policy's own single-attempt defaults)."""
        if isinstance(value, Mapping):
            return {**asdict(EVAL_RETRY), **value}
        return value

    @model_validator(mode="after")
    def _check_urls(self) -> EvalConfig:
        for i, url in enumerate(self.base_urls):
            if not url.startswith(("http://", "https://")):
                raise EvalConfigError(f"base_urls.{i}: {url!r} is not an http(s) URL (http://host:port/v1)")
        return self

    @model_validator(mode="after")
    def _gym_to_use(self) -> EvalConfig:
        """``config_paths`` to start Gym with, or ``gym_head``: a running Gym, whose config is its own and whose model
        server calls the endpoints it was started with (an embedded server of this run would be one it never calls)."""
        if self.policies is not None:
            if self.gym_head is not None:
                raise EvalConfigError(
                    "gym_head: a running Gym's model server calls the one endpoint it was started with; several "
                    "policies need a Gym each (leave gym_head out, or run one policy against it)"
                )
            return self
        if self.gym_head is None:
            if not self.config_paths:
                raise EvalConfigError(
                    "config_paths: no Gym server config; give config_paths (Gym is started for the run), or gym_head "
                    "(http://host:port of a running Gym's head server)"
                )
            return self
        from gym_bridge.failures import SettingError
        from gym_bridge.gym.servers.server_config import head_address

        try:
            head_address(self.gym_head)
        except SettingError as exc:
            raise EvalConfigError(f"gym_head: {exc}") from None
        changes = [key for key in ("config_paths", "gym_overrides") if getattr(self, key)]
        if changes:
            raise EvalConfigError(
                f"gym_head: a running Gym keeps the config it was started with; {' and '.join(changes)} would change "
                "it (give them to the command that starts that Gym, or leave gym_head out)"
            )
        if self.embedded:
            raise EvalConfigError(
                "gym_head: a running Gym's model server calls the endpoint it was started with (its policy_base_url), "
                "never this run's embedded policy; give that endpoint as base_urls"
            )
        return self

    @model_validator(mode="after")
    def _named_key_is_set(self) -> EvalConfig:
        """A key variable named explicitly must hold a key when the run calls endpoints of its own."""
        if "api_key_env_var" in self.model_fields_set and not self.embedded and self.api_key() is None:
            raise EvalConfigError(f"api_key_env_var: the environment variable {self.api_key_env_var} is not set")
        return self

    @model_validator(mode="after")
    def _embedded_model_names(self) -> EvalConfig:
        """An embedded model policy names the tokenizer and served name unless they are given."""
        if self.embedded_policy == "scripted" or self.policies is not None:
            return self
        if "tokenizer" not in self.model_fields_set:
            self.tokenizer = self.embedded_policy
        if "model_name" not in self.model_fields_set:
            self.model_name = self.embedded_policy
        if self.embedded and self.tokenizer in ("tiny", "smollm2") and self.tokenizer != self.embedded_policy:
            raise EvalConfigError(
                f"tokenizer: {self.tokenizer!r} is not the tokenizer of embedded_policy {self.embedded_policy!r}; "
                "leave tokenizer out (or pass the embedded model's folder)"
            )
        return self

    @model_validator(mode="after")
    def _check_policies(self) -> EvalConfig:
        """``policies`` excludes the top-level policy keys; each entry becomes a valid single-policy config."""
        if self.policies is None:
            return self
        mixed = [key for key in POLICY_KEYS if key in self.model_fields_set]
        if mixed:
            raise EvalConfigError(
                f"policies: give {', '.join(mixed)} inside each policy entry, not beside policies "
                f"(one form or the other: policies, or the top-level {' / '.join(POLICY_KEYS)})"
            )
        if not self.policies:
            raise EvalConfigError("policies: the list is empty; give at least one entry (name plus base_urls or "
                             "embedded_policy)")  # fmt: skip
        shared = self.model_dump(mode="json", exclude_unset=True, exclude={"policies"})
        seen: dict[str, int] = {}
        configs = []
        for i, entry in enumerate(self.policies):
            label = f"policy {entry.name!r} (policies.{i})"
            if not _POLICY_NAME.fullmatch(entry.name):
                raise EvalConfigError(f"{label}: name: use letters, digits, '.', '_' and '-' (it names a folder)")
            if entry.name in seen:
                raise EvalConfigError(
                    f"{label}: name: {entry.name!r} is already the name of policies.{seen[entry.name]}"
                )
            seen[entry.name] = i
            keys = entry.keys()
            if not keys.get("base_urls") and "embedded_policy" not in keys:
                raise EvalConfigError(f"{label}: base_urls: no endpoint; give base_urls, or embedded_policy for an "
                                 "embedded model")  # fmt: skip
            if keys.get("base_urls") and "embedded_policy" in keys:
                raise EvalConfigError(f"{label}: embedded_policy: give base_urls or embedded_policy, not both")
            data = {**shared, **keys, "output_dir": str(self.output_dir / entry.name)}
            try:
                configs.append((entry.name, EvalConfig.model_validate(data)))
            except ValidationError as exc:
                raise EvalConfigError(f"{label}: {format_errors(exc, EvalConfig.model_fields, prefix='')}") from None
        self._policy_configs = configs
        return self

    def policy_configs(self) -> list[tuple[str, EvalConfig]]:
        """``(name, config)`` per entry of ``policies``, in order, each a single-policy config whose
        ``output_dir`` is ``<output_dir>/<name>``; empty for a single-policy config."""
        return list(self._policy_configs)

    @property
    def embedded(self) -> bool:
        return not self.base_urls

    def api_key(self) -> SecretStr | None:
        """The endpoints' API key, read from ``$api_key_env_var`` now; None when it is unset or empty."""
        value = os.environ.get(self.api_key_env_var, "")
        return SecretStr(value) if value else None

    def retry_policy(self) -> RolloutRetryPolicy:
        """The run's retry policy: the ``retry:`` section."""
        return self.retry

    def generation_config(self) -> GenerationConfig:
        """The sampling every row is stamped with."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens}

    @property
    def routing(self) -> RowRouting:
        """Gym's routing keys as one setting (:class:`~gym_bridge.gym.protocol.routing.RowRouting`)."""
        return RowRouting(agent_name=self.agent_name, agent_map=self.agent_map, fan_out=self.fan_out)

    @model_validator(mode="after")
    def _routing_consistent(self) -> EvalConfig:
        self.routing  # noqa: B018 - RowRouting checks the three keys together
        return self

    def fingerprint(self, dataset_sha256: str) -> JsonObject:
        """The settings a resumed run must share with the original (results would not be comparable otherwise)."""
        return {
            "dataset_sha256": dataset_sha256,
            "num_generations_per_prompt": self.num_generations_per_prompt,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "max_seq_len": self.max_seq_len,
            "policy": f"embedded:{self.embedded_policy}" if self.embedded else "endpoint",
            "base_urls": list(self.base_urls),
            "model_name": self.model_name,
            "tokenizer": self.tokenizer,
            "seed": self.seed,
            "config_paths": list(self.config_paths),
            "gym_overrides": self.gym_overrides,
            **({"gym_head": self.gym_head} if self.gym_head is not None else {}),
            **({"routing": self.routing.model_dump(mode="json")} if not self.routing.is_empty else {}),
        }


def parse_override(text: str) -> tuple[list[str], object]:
    """``a.b=value`` -> ``(["a", "b"], yaml value)``: the key's parts each named (at most ``MAX_KEY_PARTS``), the
    value plain YAML data, finite and bounded in depth (:mod:`gym_bridge.config.values`)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise EvalConfigError(f"override {shown(text[:200])!r} is not key=value")
    where = f"override {shown(key.strip()[:200])}"
    if key.strip()[:1] in ("+", "~"):
        raise EvalConfigError(
            f"{where}: eval overrides are key=value (+key, ++key and ~key are the training command's forms)"
        )
    try:
        parts = key_parts(key, where)
        value = config_yaml(raw, where) if raw.strip() else None
    except UntrustedInputError as exc:
        raise EvalConfigError(str(exc)) from None
    return parts, value


def build_config(data: JsonMapping, overrides: Sequence[str] = ()) -> EvalConfig:
    """Apply ``overrides`` to ``data`` and validate."""
    merged = dict(data)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
            node[part] = child = dict(child)
            node = child
        node[path[-1]] = value
    try:
        return EvalConfig.model_validate(merged)
    except ValidationError as exc:
        raise EvalConfigError(format_errors(exc, EvalConfig.model_fields, data=merged)) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> EvalConfig:
    """Read a YAML eval config (a regular file; aliases bounded: :mod:`gym_bridge.boundary.yaml_io`), apply
    ``key=value`` overrides, validate."""
    path = Path(path)
    try:
        data = config_yaml(read_text(path, MAX_CONFIG_BYTES), shown(path)) or {}
    except OSError as exc:
        raise EvalConfigError(f"cannot read the eval config {shown(path)}: {exc.strerror or exc}") from None
    except UntrustedInputError as exc:
        raise EvalConfigError(str(exc)) from None
    if not isinstance(data, dict):
        raise EvalConfigError(f"{path}: the eval config must be a mapping of keys, got {type(data).__name__}")
    return build_config(data, overrides)
