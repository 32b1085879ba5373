"""Gym 0.7's token-id capture, for agents whose responses carry no token ids (external harnesses).

With ``token_id_capture: {enabled: true, ...}`` in Gym's global config (``gym_overrides`` of an eval,
``env.nemo_gym.token_id_capture`` of a training config, as Gym names it), Gym's model server records each model
call's token ids and sampling logprobs under the rollout's capture key (built from the ``_ng_*`` identity every
row carries, :func:`gym_bridge.gym.protocol.numbering.rollout_identity`) in a file store. Gym's own collection then
finalises
each result: it rebuilds ``response.output`` from the frozen records (``finalize_rollout_token_capture``). The
NemoGym actor does the same with Gym's own functions, before converting the result, so a ``Completion`` holds the
token ids and logprobs the endpoint produced. A result that already carries token ids is left as it is; one
whose capture is missing or ambiguous comes back masked (``mask_sample``), never as fake tokens.

Every key of Gym 0.7's block (``token_id_capture/config.py``: ``TokenIdCaptureSettings``) is applied or refused in
one line (:func:`capture_block`):

- applied: ``enabled``; ``all_agents`` (Gym's agents read it to route their model calls through capture, and the
  actor finalises exactly the results of the agents Gym's ``token_id_capture_enabled_for_agent`` names, on the
  launched config); ``dir`` (the file store, default ``<log_dir>/token-captures``); ``delta_records`` (Gym's model
  server writes them, Gym's finaliser reads them); ``rebuild_response: true`` (the actor rebuilds);
  ``max_mask_fraction`` with ``mask_fraction_min_samples`` (:class:`MaskFractionWatch`, Gym's abort, on the driver);
- refused when set to anything but Gym's default: ``sink``, ``sink_kwargs``, ``lineage_store``,
  ``lineage_store_kwargs``, ``allow_unresolved_continuations`` (they replace or only concern a custom sink; the actor
  reads Gym's file store), ``rebuild_response: false`` (the actor is the reader that rebuilds), ``external_staging``,
  ``external_staging_backend``, ``control_auth_token_env`` (framework-owned staging in the inference workers);
  and any key Gym's block does not have.

Gym is imported here only when capture is on, inside the actor.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.boundary.files import make_dir
from gym_bridge.failures import SettingError, TokenCaptureMasked
from gym_bridge.gym_versions import ROLLOUT_IDENTITY_KEYS, installed_gym
from gym_bridge.json_types import JsonObject

CAPTURE_KEY = "token_id_capture"
"""Gym's run-level block in its global config."""

_APPLIED_KEYS = frozenset(
    {
        "enabled",
        "all_agents",
        "dir",
        "delta_records",
        "rebuild_response",
        "max_mask_fraction",
        "mask_fraction_min_samples",
    }
)
_REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, str]] = {
    "sink": (None, "the NemoGym actor finalises captures from Gym's file store (token_id_capture.dir)"),
    "sink_kwargs": ({}, "it configures a custom sink, which is refused"),
    "lineage_store": (None, "the NemoGym actor reads Gym's file store, whose own lineage it keeps"),
    "lineage_store_kwargs": ({}, "it configures a custom lineage_store, which is refused"),
    "allow_unresolved_continuations": (False, "it only concerns a custom sink, which is refused"),
    "rebuild_response": (True, "the NemoGym actor is the reader that rebuilds each result's tokens"),
    "external_staging": (False, "framework-owned staging in the inference workers is not supported"),
    "external_staging_backend": ("vllm_worker", "it configures external_staging, which is refused"),
    "control_auth_token_env": (
        "NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN",
        "it configures external_staging, which is refused",
    ),
}
"""Gym 0.7's keys gym-bridge does not apply: each with Gym's default (accepted) and why any other value is refused."""
GYM_CAPTURE_KEYS = _APPLIED_KEYS | frozenset(_REFUSED_UNLESS_DEFAULT)
"""Every key of Gym 0.7's ``token_id_capture`` block (``TokenIdCaptureSettings``)."""
DEFAULT_MIN_SAMPLES = 50
"""Gym's ``mask_fraction_min_samples`` default."""


@dataclass(frozen=True, slots=True)
class CaptureBuild:
    """What Gym's finaliser made of one result, as Gym's collection counts it against ``max_mask_fraction``."""

    masked: bool
    """The build could not give the result its token ids (Gym's ``mask_sample``)."""
    reasons: tuple[str, ...] = ()
    """Why, in Gym's words: ``capture_incomplete``, ``unresolved_parent_calls``, the build's error."""
    max_mask_fraction: float | None = None
    """The run's limit (``token_id_capture.max_mask_fraction``); None: no limit."""
    min_samples: int = DEFAULT_MIN_SAMPLES
    """``token_id_capture.mask_fraction_min_samples``: builds counted before the limit applies."""


def capture_block(overrides: Mapping[str, Any]) -> JsonObject | None:
    """The ``token_id_capture`` block of Gym's global config when it is switched on, else None.

    :class:`SettingError` (one line) for a block that is not a mapping, on a Gym without capture (before 0.7), for a
    key Gym's block does not have, for a key gym-bridge does not apply set to anything but Gym's default, and for
    a ``max_mask_fraction`` / ``mask_fraction_min_samples`` Gym would not take."""
    block = overrides.get(CAPTURE_KEY)
    if block is None or block is False:
        return None
    if not isinstance(block, Mapping):
        raise SettingError(
            f"{CAPTURE_KEY} must be a mapping (Gym's block: enabled, all_agents, dir, ...), got {block!r}"
        )
    if not block.get("enabled"):
        return None
    gym = installed_gym()
    if not gym.token_id_capture:
        raise SettingError(f"{CAPTURE_KEY} needs nemo-gym >= 0.7 ({gym.label} is installed and has no token capture)")
    unknown = sorted(set(block) - GYM_CAPTURE_KEYS)
    if unknown:
        raise SettingError(
            f"{CAPTURE_KEY}: unknown key(s) {unknown}; Gym's block has {', '.join(sorted(GYM_CAPTURE_KEYS))}"
        )
    for key, (default, why) in _REFUSED_UNLESS_DEFAULT.items():
        if key in block and block[key] != default:
            raise SettingError(
                f"{CAPTURE_KEY}.{key} is not supported (set to {block[key]!r}, Gym's default {default!r}): {why}"
            )
    mask_limit(block)
    return dict(block)


def mask_limit(block: Mapping[str, Any]) -> tuple[float | None, int]:
    """``(max_mask_fraction, mask_fraction_min_samples)`` of a capture block, checked as Gym's settings check them."""
    fraction = block.get("max_mask_fraction")
    min_samples = block.get("mask_fraction_min_samples", DEFAULT_MIN_SAMPLES)
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not math.isfinite(fraction)
    ):
        raise SettingError(f"{CAPTURE_KEY}.max_mask_fraction must be a number or null, got {fraction!r}")
    if isinstance(min_samples, bool) or not isinstance(min_samples, int):
        raise SettingError(f"{CAPTURE_KEY}.mask_fraction_min_samples must be an int, got {min_samples!r}")
    return (None if fraction is None else float(fraction)), min_samples


def with_capture_dir(overrides: JsonObject, default_dir: Path | None) -> tuple[JsonObject, Path | None]:
    """``overrides`` with the capture store's folder set (the block's ``dir``, else ``default_dir``, else a fresh
    temporary folder: capture keys repeat across runs), and that folder; ``(overrides, None)`` when capture is off."""
    block = capture_block(overrides)
    if block is None:
        return overrides, None
    folder = Path(block.get("dir") or default_dir or tempfile.mkdtemp(prefix="gym-bridge-token-capture-"))
    return {**overrides, CAPTURE_KEY: {**block, "dir": str(folder)}}, folder


class TokenCapture:
    """Gym's file store of one server set's captures, finalised the way Gym's collection finalises them."""

    def __init__(self, folder: Path, block: Mapping[str, Any] | None = None) -> None:
        from nemo_gym.token_id_capture.store import TokenCaptureStore

        self.folder = make_dir(folder)
        self._store = TokenCaptureStore(folder)
        self.max_mask_fraction, self.min_samples = mask_limit(block or {})
        self._participants: Collection[str] | None = None
        """The agents whose results are finalised; None: every agent (until :meth:`read_participants`)."""

    def read_participants(self, global_config: Mapping[str, Any], agents: Collection[str]) -> None:
        """Keep the agents Gym's collection finalises under the launched config (as its head server serves it):
        ``token_id_capture_enabled_for_agent``: ``all_agents``, or the agent's own ``token_id_capture`` flag."""
        from nemo_gym.token_id_capture.config import token_id_capture_enabled_for_agent
        from omegaconf import OmegaConf

        config = OmegaConf.create(dict(global_config))
        self._participants = frozenset(a for a in agents if token_id_capture_enabled_for_agent(config, a))

    def participates(self, agent: str) -> bool:
        """Whether Gym's collection would finalise a result of ``agent``."""
        return self._participants is None or agent in self._participants

    def clear(self, row: Mapping[str, Any]) -> None:
        """Forget earlier records of the rollout ``row`` is about to start (capture keys are deterministic, and
        the store appends), as Gym clears rows it is about to dispatch."""
        from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body

        rollout_id = maybe_rollout_id_from_run_body(row)
        if rollout_id:
            self._store.delete(rollout_id)

    async def finalize(self, row: Mapping[str, Any], result: JsonObject) -> CaptureBuild | None:
        """Rebuild ``result``'s ``response.output`` from its captured model calls (in place), keyed by the row's
        identity, which is stamped on the result first (:func:`stamp_identity`), as Gym's collection does.

        The build as Gym's collection counts it for ``max_mask_fraction``: None when Gym made none, else whether it
        is masked, why (Gym's reasons: ``capture_incomplete``, ``unresolved_parent_calls``, the build's error) and
        the run's limit."""
        from nemo_gym.token_id_capture.delivery import finalize_rollout_token_capture

        stamp_identity(row, result)
        build = await finalize_rollout_token_capture(result, self._store)
        if build is None:
            return None
        masked = bool(build.get("mask_sample"))
        reasons: list[str] = []
        if masked:
            metrics = build.get("metrics") or {}
            reasons += [key for key in ("capture_incomplete", "unresolved_parent_calls") if metrics.get(key)]
            error = build.get("error") or metrics.get("error")
            if error:
                reasons.append(str(error))
        return CaptureBuild(masked, tuple(reasons), self.max_mask_fraction, self.min_samples)


def stamp_identity(row: Mapping[str, Any], result: JsonObject) -> JsonObject:
    """``result`` (in place) with the ``_ng_*`` rollout identity of the row it answers, replacing what the agent
    echoed, as Gym's collection stamps every result it records: whatever the agent returns, a result carries its
    task index, rollout index, attempt and rollout id (those the row carries: the installed Gym's keys)."""
    for key in ROLLOUT_IDENTITY_KEYS:
        if key in row:
            result[key] = row[key]
    return result


@dataclass
class MaskFractionWatch:
    """Gym's abort on masked token captures (``rollout_collection.py``, ``max_mask_fraction``), over one client's run.

    Every finalised build counts; after ``mask_fraction_min_samples`` of them, a masked share above
    ``max_mask_fraction`` raises :class:`TokenCaptureMasked` with Gym's message. The first such error is kept
    (:attr:`stopped`): the run is over, and every later call raises it again."""

    finalized: int = 0
    masked: int = 0
    reasons: Counter[str] | None = None
    stopped: TokenCaptureMasked | None = None

    def record(self, build: CaptureBuild | None) -> None:
        """Count one result's build (None: none was made); raise :class:`TokenCaptureMasked` when Gym would abort."""
        if self.stopped is not None:
            raise self.stopped
        if build is None:
            return
        self.finalized += 1
        if build.masked:
            self.masked += 1
            reasons = self.reasons if self.reasons is not None else Counter()
            reasons.update(build.reasons)
            self.reasons = reasons
        limit = build.max_mask_fraction
        if limit is not None and self.finalized >= build.min_samples and self.masked / self.finalized > limit:
            self.stopped = TokenCaptureMasked(
                f"{self.masked}/{self.finalized} finalized rollouts ({self.masked / self.finalized:.1%}) are masked, "
                f"exceeding token_id_capture.max_mask_fraction={limit}. Mask reasons: {dict(self.reasons or {})}. "
                "Aborting instead of collecting mostly token-less data."
            )
            raise self.stopped
