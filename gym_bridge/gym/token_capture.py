"""Gym 0.7's token-id capture, for agents whose responses carry no token ids (external harnesses).

With ``token_id_capture: {enabled: true, ...}`` in Gym's global config (``gym_overrides`` of an eval,
``env.nemo_gym.token_id_capture`` of a training config, as Gym names it), Gym's model server records each model
call's token ids and sampling logprobs under the rollout's capture key (built from the ``_ng_*`` identity every
row carries, :func:`gym_bridge.gym.rows.rollout_identity`) in a file store. Gym's own collection then finalises
each result: it rebuilds ``response.output`` from the frozen records (``finalize_rollout_token_capture``). The
NemoGym actor does the same with Gym's own functions, before converting the result, so a ``Completion`` holds the
token ids and logprobs the endpoint produced. A result that already carries token ids is left as it is; one
whose capture is missing or ambiguous comes back masked (``mask_sample``), never as fake tokens.

Gym is imported here only when capture is on, inside the actor.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gym_bridge.failures import SettingError
from gym_bridge.gym.versions import ROLLOUT_IDENTITY_KEYS, installed_gym
from gym_bridge.json_types import JsonObject

CAPTURE_KEY = "token_id_capture"
"""Gym's run-level block in its global config."""


def capture_block(overrides: Mapping[str, Any]) -> JsonObject | None:
    """The ``token_id_capture`` block of Gym's global config when it is switched on, else None.

    :class:`SettingError` for a block that is not a mapping, or on a Gym without capture (before 0.7)."""
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
    if block.get("sink") is not None:
        raise SettingError(
            f"{CAPTURE_KEY}.sink is not supported: the NemoGym actor finalises captures from Gym's file store "
            "(token_id_capture.dir)"
        )
    return dict(block)


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

    def __init__(self, folder: Path) -> None:
        from nemo_gym.token_id_capture.store import TokenCaptureStore

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._store = TokenCaptureStore(folder)

    def clear(self, row: Mapping[str, Any]) -> None:
        """Forget earlier records of the rollout ``row`` is about to start (capture keys are deterministic, and
        the store appends), as Gym clears rows it is about to dispatch."""
        from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body

        rollout_id = maybe_rollout_id_from_run_body(row)
        if rollout_id:
            self._store.delete(rollout_id)

    async def finalize(self, row: Mapping[str, Any], result: JsonObject) -> JsonObject:
        """``result`` with ``response.output`` rebuilt from its captured model calls (in place), keyed by the row's
        identity, which Gym's collection also copies onto the result first."""
        from nemo_gym.token_id_capture.delivery import finalize_rollout_token_capture

        for key in ROLLOUT_IDENTITY_KEYS:
            if key in row and key not in result:
                result[key] = row[key]
        await finalize_rollout_token_capture(result, self._store)
        return result
