"""Names for JSON-shaped data whose fields another system defines: Gym rows and results, OpenAI request and
response bodies, NeMo-RL config sections. The name says what the value is; its fields are that system's
contract, which gym-bridge reads key by key and does not model as a whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

type JsonObject = dict[str, Any]
"""A parsed JSON object, or one being built to send."""

type JsonMapping = Mapping[str, Any]
"""A JSON object (or a config section parsed from YAML) that the receiving function only reads."""
