"""One policy an eval config names: a served endpoint's keys or an embedded policy (``tiny``, ``smollm2``,
``scripted`` or a local model folder), and one entry of ``policies:`` (a name plus those keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gym_bridge.json_types import JsonObject

EMBEDDED_NAMES = ("tiny", "smollm2", "scripted")


def _embedded_policy(value: str) -> str:
    """A built-in name, or a local model folder (one ``from_pretrained`` loads: it holds ``config.json``)."""
    if value in EMBEDDED_NAMES:
        return value
    folder = Path(value).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{value!r} is neither one of {', '.join(EMBEDDED_NAMES)} nor a local model folder (no config.json there)"
        )
    return value


EmbeddedPolicy = Annotated[str, AfterValidator(_embedded_policy)]
"""``tiny``, ``smollm2``, ``scripted`` or the path of a local model folder."""


class PolicyEntry(BaseModel):
    """One entry of ``policies:``: a name (its run folder) and the keys of one policy."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The policy's name: its run folder under output_dir and its label in compare.")
    base_urls: list[str] | None = None
    model_name: str | None = None
    tokenizer: str | None = None
    api_key_env_var: str | None = None
    embedded_policy: EmbeddedPolicy | None = None

    def keys(self) -> JsonObject:
        """The policy keys this entry sets (``name`` excluded)."""
        return self.model_dump(exclude={"name"}, exclude_none=True)
