"""Data contracts shared by every rollout path.

Field names, shapes and dtypes follow NeMo-RL's bridge so that a training loop
written against NeMo-RL consumes these records unchanged. One deliberate
difference: every ``token_ids`` tensor is int64, including empty ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NotRequired, Protocol, TypedDict

import torch

from gym_bridge.failures.errors import SettingError
from gym_bridge.json_types import JsonMapping, JsonObject

TOKEN_DTYPE = torch.int64
LOGPROB_DTYPE = torch.float32


class MessageEntry(TypedDict, total=False):
    """One message of a message log; ``token_ids`` is always a 1-D int64 tensor."""

    role: str
    content: str
    token_ids: torch.Tensor
    generation_logprobs: torch.Tensor
    is_invalid_tool_call: bool
    has_malformed_thinking: bool
    token_loss_mask: torch.Tensor


LLMMessageLogType = list[MessageEntry]


class Tokenizer(Protocol):
    """What gym-bridge uses of a tokenizer; any Hugging Face ``PreTrainedTokenizerBase`` satisfies it."""

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str: ...

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False) -> list[str]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: Any, **kwargs: Any) -> Any: ...


def padding_id(tokenizer: Tokenizer) -> int:
    """The id that pads token batches: the tokenizer's pad token, else its EOS token (as NeMo-RL pads)."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    raise SettingError("the tokenizer has neither a pad_token_id nor an eos_token_id to pad batches with")


class RemoteMethod(Protocol):
    """A Ray actor method: ``.remote(...)`` submits a call, ``.options(...)`` sets call options."""

    def remote(self, *args: object, **kwargs: object) -> Any: ...

    def options(self, **options: object) -> RemoteMethod: ...


class ActorHandle(Protocol):
    """A Ray actor handle as gym-bridge calls it: every attribute is a :class:`RemoteMethod`."""

    def __getattr__(self, name: str) -> RemoteMethod: ...


class DatumSpec(TypedDict, total=False):
    """One prompt as the dataset hands it to a rollout backend.

    For the NeMo-Gym path ``extra_env_info`` is the Gym input row.
    Extra keys are allowed and carried through.
    """

    message_log: LLMMessageLogType
    length: int
    extra_env_info: JsonObject | None
    loss_multiplier: float
    idx: int
    task_name: NotRequired[str]
    stop_strings: NotRequired[list[str] | None]


@dataclass
class Completion:
    """One finished trajectory: the full message log (prompt included) and its reward.

    ``truncated`` means what it means in NeMo-RL on the path that made the completion
    (see :mod:`gym_bridge.rollout.truncation`). ``token_drift`` is ours: a Gym turn's
    prompt did not extend the previous turn's tokens (details in ``env_extras["token_drift"]``).
    ``masked`` and ``failure_kind`` carry the environment's own verdict (Gym 0.7).
    """

    message_log: LLMMessageLogType
    env_extras: JsonObject | None
    truncated: bool
    reward: float
    token_drift: bool = False
    masked: bool = False
    """The environment flagged the reward as no valid measurement (Gym's ``mask_sample``): kept, counted, and
    left out of the loss and of its group's baseline and std. Never a zero reward in disguise."""
    failure_kind: str | None = None
    """Gym's ``failure_kind`` for this sample, if the environment named one."""
    incomplete_reason: str | None = None
    """Gym's ``response.incomplete_details.reason`` (``max_output_tokens``, ...), if the response was cut."""
    seed: int | None = None
    """The sampling seed the row was sent with (the endpoint's per-request ``seed``); None: unseeded."""
    agent: str | None = None
    """The Gym agent that ran the trajectory (its row's ``agent_ref.name`` once routed), kept beside Gym's result
    so per-agent metrics need not write into it; None on a path without agents."""
    reward_components: dict[str, float] | None = None
    """A multi-reward verifier's scores by name (Gym's ``reward_components``, checked finite): GDPO's
    ``reward/<name>`` columns. Unshaped, like ``env_extras``; None for a single-reward environment."""


@dataclass
class PromptGroupRecord:
    """The N completions of one prompt, in generation-index order, with group metrics."""

    prompt_idx: int
    prompt: LLMMessageLogType
    extra_env_info: JsonObject | None
    metadata: JsonObject
    completions: list[Completion]
    rollout_metrics: JsonObject = field(default_factory=dict)
    """NeMo-RL's metric names; values are numbers, lists (histograms) or tables."""


class ColocationResources(TypedDict, total=False):
    gpus_per_node: int | None
    num_nodes: int | None


class ColocationConfig(TypedDict, total=False):
    enabled: bool
    resources: ColocationResources


class GenerationConfig(TypedDict, total=False):
    """Sampling and engine settings; the ``val_*`` fields are the validation profile."""

    backend: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    val_temperature: float
    val_top_p: float
    val_top_k: int | None
    stop_token_ids: list[int] | None
    stop_strings: list[str] | None
    model_name: str
    bad_words: list[str] | None
    colocated: ColocationConfig
    port_range_low: int
    port_range_high: int
    use_async_rollouts: bool
    vllm_cfg: JsonObject
    _pad_token_id: int


@dataclass(frozen=True)
class GenerationSamplingParams:
    """One sampling profile (train or validation) taken from a GenerationConfig."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    @classmethod
    def from_generation_config(cls, cfg: JsonMapping, *, validation: bool = False) -> GenerationSamplingParams:
        """The ``val_*`` profile when ``validation`` (each field falling back to the training one), else training's.

        ``cfg`` is a :class:`GenerationConfig` or any mapping with its keys.
        """
        prefix = "val_" if validation else ""
        return cls(
            temperature=float(cfg.get(f"{prefix}temperature", cfg.get("temperature", 1.0))),
            top_p=float(cfg.get(f"{prefix}top_p", cfg.get("top_p", 1.0))),
            top_k=cfg.get(f"{prefix}top_k", cfg.get("top_k")),
        )


class GenerationDatumSpec(TypedDict):
    """Generation input: ``input_ids`` [B, S] right-padded, ``input_lengths`` [B]."""

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    stop_strings: NotRequired[list[list[str] | None] | None]


class GenerationOutputSpec(TypedDict):
    """Generation output.

    ``output_ids`` [B, S'] holds the input followed by generated tokens, right-padded;
    ``logprobs`` [B, S'] is zero on prompt and padding positions;
    ``unpadded_sequence_lengths`` = input length + ``generation_lengths``;
    ``truncated`` [B] is True where the token cap was hit without a stop;
    ``weight_version`` [B] int64, from engines that take weight refits: the version of
    the weights that generated each row.
    """

    output_ids: torch.Tensor
    generation_lengths: torch.Tensor
    unpadded_sequence_lengths: torch.Tensor
    logprobs: torch.Tensor
    truncated: NotRequired[torch.Tensor]
    weight_version: NotRequired[torch.Tensor]


class LogprobOutputSpec(TypedDict):
    """``PolicyInterface.get_logprobs`` output: ``logprobs`` [B, S]."""

    logprobs: torch.Tensor


class ReferenceLogprobOutputSpec(TypedDict):
    """``PolicyInterface.get_reference_policy_logprobs`` output: ``reference_logprobs`` [B, S]."""

    reference_logprobs: torch.Tensor


class TopkLogitsOutputSpec(TypedDict):
    """``PolicyInterface.get_topk_logits`` output: ``topk_logits`` and their token ids ``topk_indices``, [B, S-1, k]."""

    topk_logits: torch.Tensor
    topk_indices: torch.Tensor


class EnvironmentReturn[MetadataT](NamedTuple):
    """What ``EnvironmentInterface.step`` returns; the positional order is part of the contract.

    ``answers`` is NeMo-RL HEAD's sixth field; the documented interface has five, so it defaults to None
    and environments may return either (a plain 5- or 6-tuple too). Generic in the metadata type, as in HEAD.
    """

    observations: list[dict[str, str]]
    metadata: list[MetadataT]
    next_stop_strings: list[list[str] | None] | None
    rewards: torch.Tensor | dict[str, torch.Tensor]  # [B], or one [B] tensor per reward component
    terminateds: torch.Tensor
    answers: list[str | None] | None = None


type TokenIds = torch.Tensor | Sequence[int]
"""Token ids as a tensor or a list (a tokenizer's ``input_ids``, a slice of ``output_ids``)."""


def token_tensor(ids: TokenIds) -> torch.Tensor:
    """A 1-D int64 token tensor, also for an empty list (``torch.tensor([])`` is float32)."""
    return torch.as_tensor(ids, dtype=TOKEN_DTYPE).reshape(-1)


def logprob_tensor(values: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """A 1-D float32 logprob tensor."""
    return torch.as_tensor(values, dtype=LOGPROB_DTYPE).reshape(-1)
