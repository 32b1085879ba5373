"""Building a DatumSpec from chat messages with a tokenizer's chat template."""

from __future__ import annotations

from gym_bridge.boundary.chat_template import render_chat_template
from gym_bridge.json_types import JsonObject
from gym_bridge.types import DatumSpec, MessageEntry, Tokenizer, token_tensor


def datum_from_chat(
    tokenizer: Tokenizer,
    messages: list[JsonObject],
    *,
    idx: int,
    task_name: str | None = None,
    extra_env_info: JsonObject | None = None,
    stop_strings: list[str] | None = None,
    tools: list[JsonObject] | None = None,
) -> DatumSpec:
    """One prompt: the rendered chat (generation prompt included) as a single tokenised user message.

    The chat template renders in the bounded sandbox, as the server renders it (a model folder's template is
    untrusted): a runaway template is a ``TemplateBoundError`` naming it, not a hung trainer.
    """
    text = render_chat_template(tokenizer, messages, tools=tools, add_generation_prompt=True, template_kwargs={})
    token_ids = token_tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    datum = DatumSpec(
        message_log=[MessageEntry(role="user", content=text, token_ids=token_ids)],
        length=int(token_ids.numel()),
        extra_env_info=extra_env_info,
        loss_multiplier=1.0,
        idx=idx,
    )
    if task_name is not None:
        datum["task_name"] = task_name
    if stop_strings is not None:
        datum["stop_strings"] = stop_strings
    return datum


def datum_from_gym_row(row: JsonObject, *, idx: int, task_name: str = "nemo_gym") -> DatumSpec:
    """One Gym prompt: the row goes to ``extra_env_info``; the real prompt comes back from Gym.

    The placeholder message log holds one empty user message with an empty int64
    token tensor (NeMo-RL's placeholder is float32; ours is not).
    """
    return DatumSpec(
        message_log=[MessageEntry(role="user", content="", token_ids=token_tensor([]))],
        length=0,
        extra_env_info=row,
        loss_multiplier=1.0,
        idx=idx,
        task_name=task_name,
    )
