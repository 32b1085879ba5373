"""An upstream engine's answer, untrusted: its body read under a size cap before and after decompression, and a
completion's fields checked (token ids in the vocabulary, logprobs finite and <= 0, lengths that agree, a known
finish reason, a positive context length). Torch-free: the proxy's engine, Gym's model server and preflight share it.
Every refusal is one :class:`~gym_bridge.boundary.UntrustedInputError` naming the field.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import AsyncIterable, Iterable, Mapping
from typing import TYPE_CHECKING

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.text import shown

if TYPE_CHECKING:
    import httpx

MAX_ANSWER_BYTES = 32 << 20
"""The most of one answer read, compressed or decoded: a completion of 100,000 tokens with their logprobs is ~10 MB."""
INT64_LIMIT = 2**63
FINISH_REASONS = frozenset(
    {"stop", "length", "abort", "error", "repetition", "tool_calls", "content_filter", "function_call"}
)
"""vLLM's ``FINISH_REASON_STRINGS`` and OpenAI's finish reasons."""
_TOKEN_ID_PREFIX = "token_id:"


class BodyReader:
    """Collects a body's raw bytes, decoding ``gzip`` / ``deflate`` as they come, each call bounded so that neither
    the raw nor the decoded body grows past ``max_bytes`` (a gzip bomb is refused, never decompressed past it)."""

    def __init__(self, headers: Mapping[str, str], where: str, max_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.where = where
        self.max_bytes = max_bytes
        self._raw = 0
        self._out = bytearray()
        self._zlib = _decoder(headers.get("content-encoding", ""), where)
        length = headers.get("content-length", "")
        if length.strip().isdigit() and int(length) > max_bytes:
            self._refuse()

    def feed(self, raw: bytes) -> None:
        """Add the next raw chunk."""
        self._raw += len(raw)
        if self._raw > self.max_bytes:
            self._refuse()
        if self._zlib is None:
            self._append(raw)
            return
        data = raw
        try:
            while data:
                self._append(self._zlib.decompress(data, self.max_bytes - len(self._out) + 1))
                data = self._zlib.unconsumed_tail
        except zlib.error as exc:
            raise UntrustedInputError(f"{self.where}: the compressed body is corrupt ({exc})") from None

    def body(self) -> bytes:
        """The decoded body."""
        if self._zlib is not None:
            self._append(self._zlib.flush())
        return bytes(self._out)

    def _append(self, data: bytes) -> None:
        self._out += data
        if len(self._out) > self.max_bytes:
            self._refuse()

    def _refuse(self) -> None:
        self._out.clear()
        raise UntrustedInputError(f"{self.where}: the answer is larger than {self.max_bytes >> 20} MiB")


def _decoder(encoding: str, where: str) -> zlib._Decompress | None:
    """A zlib decoder for one ``Content-Encoding`` (none for ``identity``); a stacked or other coding is refused."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if name == "deflate":
        return zlib.decompressobj(zlib.MAX_WBITS | 32)
    raise UntrustedInputError(f"{where}: Content-Encoding {encoding!r} is not gzip, deflate or identity")


async def read_body_async(
    headers: Mapping[str, str], raw_chunks: AsyncIterable[bytes], where: str, max_bytes: int = MAX_ANSWER_BYTES
) -> bytes:
    """The decoded body of raw (undecoded) chunks, under :class:`BodyReader`'s cap."""
    reader = BodyReader(headers, where, max_bytes)
    async for chunk in raw_chunks:
        reader.feed(chunk)
    return reader.body()


def read_body(
    headers: Mapping[str, str], raw_chunks: Iterable[bytes], where: str, max_bytes: int = MAX_ANSWER_BYTES
) -> bytes:
    """:func:`read_body_async` for a synchronous stream."""
    reader = BodyReader(headers, where, max_bytes)
    for chunk in raw_chunks:
        reader.feed(chunk)
    return reader.body()


async def read_response_async(response: httpx.Response, where: str, max_bytes: int = MAX_ANSWER_BYTES) -> bytes:
    """An httpx response's decoded body under the cap, read raw from its stream (a response built in memory, as a
    mock transport's, is already decoded)."""
    if response.is_stream_consumed:
        return read_body({}, [response.content], where, max_bytes)
    return await read_body_async(response.headers, response.aiter_raw(), where, max_bytes)


def read_response(response: httpx.Response, where: str, max_bytes: int = MAX_ANSWER_BYTES) -> bytes:
    """:func:`read_response_async` for a synchronous response."""
    if response.is_stream_consumed:
        return read_body({}, [response.content], where, max_bytes)
    return read_body(response.headers, response.iter_raw(), where, max_bytes)


def is_token_id(value: object, vocab_size: int | None) -> bool:
    """An int (not a bool) in ``[0, vocab_size)``, or in int64 when the vocabulary is unknown."""
    limit = INT64_LIMIT if vocab_size is None else vocab_size
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def check_token_ids(ids: object, field: str, where: str, vocab_size: int | None) -> list[int]:
    """``ids`` as token ids; the first one outside the vocabulary (or int64) is named."""
    if not isinstance(ids, list):
        raise UntrustedInputError(f"{where}: {field} is not a list of token ids")
    for i, value in enumerate(ids):
        if not is_token_id(value, vocab_size):
            bound = f"the vocabulary of {vocab_size}" if vocab_size is not None else "int64"
            raise UntrustedInputError(f"{where}: {field}[{i}] = {_picture(value)} is not a token id within {bound}")
    return ids


def check_logprobs(values: object, field: str, where: str, count: int) -> list[float]:
    """``values`` as ``count`` logprobs: finite numbers (not bools) <= 0."""
    if not isinstance(values, list):
        raise UntrustedInputError(f"{where}: {field} is not a list")
    if len(values) != count:
        name = field.rsplit(".", 1)[-1]
        raise UntrustedInputError(f"{where}: {len(values)} {name} for {count} generated tokens ({field})")
    for i, value in enumerate(values):
        if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value <= 0):
            raise UntrustedInputError(f"{where}: {field}[{i}] = {_picture(value)} is not a finite logprob <= 0")
    return [float(v) for v in values]


def check_finish_reason(value: object, field: str, where: str) -> str:
    """``value`` as one of :data:`FINISH_REASONS`."""
    if not isinstance(value, str) or value not in FINISH_REASONS:
        raise UntrustedInputError(
            f"{where}: {field} = {_picture(value)} is not a finish reason ({', '.join(sorted(FINISH_REASONS))})"
        )
    return value


def check_max_model_len(value: object, where: str) -> int | None:
    """A model card's ``max_model_len``: absent (None) or a positive int below 2^31."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**31:
        raise UntrustedInputError(f"{where}: max_model_len = {_picture(value)} is not a positive context length")
    return value


def completion_choice(payload: object, where: str, vocab_size: int | None) -> tuple[list[int], list[float], str]:
    """(generated ids, their logprobs, finish reason) of a ``/completions`` answer's ``choices[0]``, every field
    checked; ids come from ``token_ids``, else from ``logprobs.tokens`` labels (``"token_id:<int>"``)."""
    choices = payload.get("choices") if isinstance(payload, Mapping) else None
    if not isinstance(choices, list) or not choices:
        raise UntrustedInputError(f"{where} has no choices[0]")
    choice = choices[0]
    if not isinstance(choice, Mapping):
        raise UntrustedInputError(f"{where}: choices[0] is not an object")
    lp = choice.get("logprobs")
    raw_ids = choice.get("token_ids")
    if raw_ids is None:
        tokens = lp.get("tokens") if isinstance(lp, Mapping) else None
        if tokens is None:
            raise UntrustedInputError(f"{where} has neither choices[0].token_ids nor choices[0].logprobs.tokens")
        raw_ids = _label_ids(tokens, where)
    ids = check_token_ids(raw_ids, "choices[0].token_ids", where, vocab_size)
    logprobs = lp.get("token_logprobs") if isinstance(lp, Mapping) else None
    if logprobs is None:
        raise UntrustedInputError(f"{where} has no choices[0].logprobs.token_logprobs")
    values = check_logprobs(logprobs, "choices[0].logprobs.token_logprobs", where, len(ids))
    return ids, values, check_finish_reason(choice.get("finish_reason"), "choices[0].finish_reason", where)


def decode_answer(body: bytes, where: str) -> object:
    """The JSON value of an answer's body, through the boundary's decoder."""
    return json_io.loads(body, where)


def _label_ids(tokens: object, where: str) -> list[int]:
    """The ids of ``logprobs.tokens`` labels (``"token_id:<int>"``), each a string of at most 19 digits."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise UntrustedInputError(f"{where}: logprobs.tokens is not a list of 'token_id:<int>' strings")
    labels = [t.removeprefix(_TOKEN_ID_PREFIX) for t in tokens]
    for i, label in enumerate(labels):
        if not (label.isascii() and label.isdigit() and len(label) <= 19):
            raise UntrustedInputError(f"{where}: choices[0].logprobs.tokens[{i}] is not a 'token_id:<int>' string")
    return [int(label) for label in labels]


def _picture(value: object) -> str:
    """A short, printable picture of a JSON value (a huge integer by its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return shown(text if len(text) <= 60 else text[:57] + "...")
