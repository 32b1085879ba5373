"""gym-bridge's own NeMo-Gym model server, selectable in place of Gym's ``vllm_model``.

Gym starts a server from ``<cwd>/<server_type>/<impl>`` when that folder holds a
``requirements.txt`` or ``pyproject.toml``, else from its own install. The folder
:data:`SERVER_DIR` (``app.py``, ``requirements.txt``, ``configs/``) is made visible
as ``responses_api_models/gym_bridge_model`` in the launcher's working folder
(:class:`~gym_bridge.gym.servers.server_config.GymServersConfig` ``server_dirs``), so nothing is
copied into site-packages and Gym is not patched. This module only names paths:
importing it is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["CONFIG_PATH", "IMPL", "SERVER_DIR", "SERVER_KEY", "swap_model_config"]

IMPL = "gym_bridge_model"
SERVER_KEY = f"responses_api_models/{IMPL}"
"""``<server_type>/<impl>``: where Gym looks for the server folder, relative to its working folder."""
SERVER_DIR = Path(__file__).resolve().parent / "gym_server"
CONFIG_PATH = SERVER_DIR / "configs" / f"{IMPL}.yaml"
"""Defines ``policy_model`` (as ``vllm_model_for_training.yaml`` does) on this server."""

_VLLM_MODEL_CONFIGS = "responses_api_models/vllm_model/configs/"


def swap_model_config(config_paths: Sequence[str]) -> list[str]:
    """``config_paths`` with Gym's ``vllm_model`` config(s) replaced by :data:`CONFIG_PATH` (added if absent)."""
    kept = [p for p in config_paths if _VLLM_MODEL_CONFIGS not in Path(p).as_posix()]
    return [str(CONFIG_PATH), *kept]
