"""``InstantGeneration``: a fixed answer with no model, so a benchmark measures only the plumbing around it.

Every row gets the same reply: ``answer_tokens - 1`` filler tokens (the tokenizer's
ids of ``filler``, repeated; ``" the"`` is one token in BPE vocabularies, so the
reply decodes and re-encodes to the same ids) and the EOS token, each with the
logprob :data:`INSTANT_LOGPROB`. Nothing depends on the prompt, so the cost per
row is building the output tensors. It is a
:class:`~gym_bridge.generation.scripted.ScriptedGeneration` with a fixed reply, so
``max_new_tokens`` (per row when the batch carries it) and ``max_model_len`` cut it
the same way, and a cut sets ``truncated``. Stop strings are not applied: the filler
is meant not to contain any.
"""

from __future__ import annotations

from gym_bridge.failures.errors import SettingError
from gym_bridge.generation.scripted import SCRIPTED_LOGPROB, ScriptedGeneration, ScriptedRow
from gym_bridge.types import Tokenizer

INSTANT_LOGPROB = SCRIPTED_LOGPROB


class InstantGeneration(ScriptedGeneration):
    """A generation engine that answers every prompt at once with the same fixed tokens."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        answer_tokens: int = 16,
        *,
        filler: str = " the",
        max_new_tokens: int = 256,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(tokenizer, max_new_tokens=max_new_tokens, max_model_len=max_model_len)
        if answer_tokens < 1:
            raise SettingError(f"answer_tokens must be >= 1 (the EOS token), got {answer_tokens}")
        filler_ids = list(tokenizer.encode(filler, add_special_tokens=False))
        if not filler_ids:
            raise SettingError(
                f"the filler {filler!r} encodes to no tokens; pick a filler text with at least one token"
            )
        body = [filler_ids[i % len(filler_ids)] for i in range(answer_tokens - 1)]
        self.answer: tuple[int, ...] = (*body, int(self.eos_token_id))

    def reply(self, prompt_len: int, max_new_tokens: int) -> ScriptedRow:
        """The answer for a prompt of ``prompt_len`` tokens, cut to the token budget."""
        cap = max(0, min(max_new_tokens, self.max_model_len - prompt_len))
        if len(self.answer) > cap:
            return ScriptedRow(list(self.answer[:cap]), True)
        return ScriptedRow(list(self.answer), False)

    def _row(self, prompt: list[int], row_stops: list[str], max_new_tokens: int) -> ScriptedRow:
        return self.reply(len(prompt), max_new_tokens)
