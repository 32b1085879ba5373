"""Chat templates rendered in Jinja's sandbox under a time and output bound.

A model folder's ``chat_template.jinja`` is untrusted code: a template with nested loops would hold a worker thread
(and with it ``serve``'s shutdown) for hours. :func:`render_chat_template` renders it as transformers'
``apply_chat_template`` does (the same ``ImmutableSandboxedEnvironment`` settings, globals, ``tojson`` filter,
``{% generation %}`` tag and template variables, so the text is identical for every template), and checks a
:class:`RenderBounds` deadline and output cap where a runaway template must pass: every loop iteration (each
``for`` iterates through a checking wrapper), every call, attribute and item lookup, ``*`` ``**`` ``+`` ``%`` on
values (a product or power past the cap is refused before it is built), every filter, every namespace write and
every chunk the template yields. A template past its bound raises :class:`TemplateBoundError`.

Servers render on :func:`off_the_loop`'s own pool, not asyncio's default executor: templates running to their bound
hold only render threads, never the threads that parse bodies, tokenize and build answers for other requests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gym_bridge.failures import GymBridgeError


@dataclass(frozen=True)
class RenderBounds:
    """How long one render may run and how many characters (or digits, or items) any value it builds may hold."""

    deadline_s: float = 5.0
    max_chars: int = 32 * 1024 * 1024


DEFAULT_BOUNDS = RenderBounds()
"""A chat renders in milliseconds; an 8 MiB request body (the server's cap) renders well inside both bounds."""


RENDER_THREADS = 4
"""Renders that may run at once in one process; more wait their turn, each at most its deadline."""

_RENDER_POOL = ThreadPoolExecutor(max_workers=RENDER_THREADS, thread_name_prefix="chat-template")


async def off_the_loop[**P, R](fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` (a render) on the render pool, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_RENDER_POOL, functools.partial(fn, *args, **kwargs))


class TemplateBoundError(GymBridgeError):
    """A chat template ran past its :class:`RenderBounds` (the message names the template and the bound)."""


class _Exceeded(GymBridgeError):
    """Raised inside the sandbox when a bound is passed; :func:`render_chat_template` names the template."""


class _Budget:
    """The bounds of the render running on this thread: its deadline and the characters it has yielded."""

    __slots__ = ("bounds", "deadline", "written")

    def __init__(self, bounds: RenderBounds) -> None:
        self.bounds = bounds
        self.deadline = time.monotonic() + bounds.deadline_s
        self.written = 0

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Exceeded(f"ran past its time bound of {self.bounds.deadline_s:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.bounds.max_chars:
            raise _Exceeded(f"built {what} past its output bound of {self.bounds.max_chars} characters")


_local = threading.local()


def _budget() -> _Budget | None:
    """The bounds of the render on this thread (None outside a render: a template used elsewhere is unchecked)."""
    budget: _Budget | None = getattr(_local, "budget", None)
    return budget


def _check() -> _Budget | None:
    budget = _budget()
    if budget is not None:
        budget.check()
    return budget


def _size(value: object) -> int:
    """What a value holds: characters or items, or (for an int) about its decimal digits."""
    if isinstance(value, (str, list, tuple, dict, bytes)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3
    return 0


def _check_value(budget: _Budget | None, value: object, what: str) -> None:
    if budget is not None:
        budget.check_size(_size(value), what)


def _check_args(budget: _Budget | None, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Every argument within the output cap: a width, count or string past it builds a value past it."""
    if budget is not None:
        for arg in (*args, *kwargs.values()):
            budget.check_size(_size(arg) if not isinstance(arg, int) else abs(arg), "an argument")


_WIDTH = re.compile(r"\d{7,}")
"""A run of digits long enough to be a format width past any cap worth having (checked against the cap)."""


def _check_format(budget: _Budget | None, fmt: object) -> None:
    """A ``%`` or ``str.format`` format string whose width would build a string past the cap is refused first."""
    if budget is not None and isinstance(fmt, str):
        for digits in _WIDTH.findall(fmt):
            budget.check_size(int(digits), "a format width")


class _BoundedIterable:
    """What a template's ``for`` iterates: the value itself, the deadline checked before every item."""

    __slots__ = ("_items",)

    def __init__(self, items: Any) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        budget = _budget()
        for item in self._items:
            if budget is not None:
                budget.check()
            yield item


_ITER_FILTER = "gym_bridge_bounded_iter"


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body, as transformers' ``AssistantTracker`` does
    when no assistant mask is asked for."""

    tags = {"generation"}  # noqa: RUF012 (Jinja declares it as a plain class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """``dict`` for templates, as transformers gives it: calling and ``fromkeys`` only."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace (no underscore names), each value stored within the output cap."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: ``namespace(self=...)`` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object, value: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )
        _check_value(_check(), value, "a namespace value")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _bounded_range(*args: int) -> range:
    """The sandbox's ``range`` (at most ``MAX_RANGE`` items), its size checked against the output cap."""
    budget = _check()
    _check_args(budget, args, {})
    return jinja2.sandbox.safe_range(*args)


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the deadline and its arguments checked before, and its value after (Jinja's pass-context
    marker is copied by ``functools.wraps``)."""

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _check()
        if budget is not None:
            _check_args(budget, args[1:], kwargs)
            _check_format(budget, args[0] if args else None)
            if name == "join":
                _check_join(budget, args)
        value = func(*args, **kwargs)
        _check_value(budget, value, "a filtered value")
        return value

    return bounded


def _check_join(budget: _Budget, args: tuple[Any, ...]) -> None:
    """``items|join(sep)`` builds about len(items) * len(sep) characters: refused first when that passes the cap."""
    at = next((i for i, a in enumerate(args) if not isinstance(a, jinja2.nodes.EvalContext)), len(args))
    items, sep = (*args[at:], "", "")[:2]
    if hasattr(items, "__len__") and isinstance(sep, str):
        budget.check_size(len(items) * max(len(sep), 1), "a joined string")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with the render bounds checked in the sandbox's hooks."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, func) for name, func in self.filters.items()}
        self.filters[_ITER_FILTER] = _BoundedIterable
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _Namespace
        self.globals["range"] = _bounded_range

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _check()
        if budget is not None:
            for arg in (*args, *kwargs.values()):
                budget.check_size(0 if isinstance(arg, int) else _size(arg), "an argument")
            _check_call(budget, __obj, args, kwargs)
        value = super().call(__context, __obj, *args, **kwargs)
        _check_value(budget, value, "a call's value")
        return value

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _check()
        if attribute in ("format", "format_map") and isinstance(obj, str):
            _check_format(budget, obj)  # the sandbox wraps str.format: its call sees no string
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _check()
        if budget is not None:
            budget.check_size(_binop_size(operator, left, right), f"a value with {operator!r}")
            if operator == "%":
                _check_format(budget, left)
        value = super().call_binop(context, operator, left, right)
        _check_value(budget, value, f"a value with {operator!r}")
        return value


def _check_call(budget: _Budget, obj: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """A string method whose value would pass the cap (a width, a ``format`` width, a ``replace`` that multiplies,
    a ``join``) is refused before it runs."""
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    _check_args(budget, args, kwargs)
    name = getattr(obj, "__name__", "")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = owner.count(args[0]) if args[0] else len(owner) + 1
        budget.check_size(len(owner) + hits * len(args[1]), "a replaced string")
    elif name == "join" and args and isinstance(args[0], (list, tuple, str)):
        budget.check_size(len(args[0]) * max(len(owner), 1), "a joined string")


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """About what ``left operator right`` would hold, computed before it is built."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            return _size(left) + _size(right)
        seq, count = (left, right) if isinstance(right, int) else (right, left)
        return _size(seq) * count if isinstance(count, int) else 0
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        return _size(left) * right + right // 3
    if operator == "+":
        return _size(left) + _size(right)
    return 0


_ENVIRONMENT = BoundedSandbox()


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox, every ``for`` iterating through the deadline check."""
    tree = _ENVIRONMENT.parse(source)
    for loop in tree.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Filter(loop.iter, _ITER_FILTER, [], [], None, None, lineno=loop.lineno)
    return _ENVIRONMENT.from_string(tree)


def render_template(
    source: str, variables: Mapping[str, Any], *, name: str, bounds: RenderBounds = DEFAULT_BOUNDS
) -> str:
    """``source`` rendered with ``variables`` within ``bounds``.

    Raises:
        TemplateBoundError: ``the chat template of NAME ran past its time bound of 5 s`` (or its output bound).
        jinja2.TemplateError: the template itself failed (a syntax error, ``raise_exception``).
    """
    template = compile_template(source)
    budget = _Budget(bounds)
    previous, _local.budget = _budget(), budget
    chunks: list[str] = []
    try:
        for chunk in template.generate(**variables):
            budget.written += len(chunk)
            budget.check_size(budget.written, "a rendered text")
            budget.check()
            chunks.append(chunk)
    except _Exceeded as exc:
        raise TemplateBoundError(f"the chat template of {name} {exc}") from None
    finally:
        _local.budget = previous
    return "".join(chunks)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning goes under (transformers fills the first two from whichever is set)."""


def render_chat_template(
    tokenizer: Any,
    messages: list[Any],
    *,
    tools: list[Any] | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
    bounds: RenderBounds = DEFAULT_BOUNDS,
) -> str:
    """The text ``tokenizer.apply_chat_template(messages, tools=..., tokenize=False, ...)`` renders, within ``bounds``.

    The variables are built as transformers 5 builds them: keys holding None dropped, the tokenizer's special
    tokens under the caller's kwargs, reasoning aliased, every value rebuilt from plain JSON types.

    Raises:
        TemplateBoundError: the template ran past ``bounds``.
        ValueError: the tokenizer has no chat template, or the chat is empty.
        jinja2.TemplateError: the template failed.
    """
    source = tokenizer.get_chat_template(None, tools)
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = [_with_reasoning(_plain({k: v for k, v in m.items() if v is not None})) for m in messages]
    variables = _plain({**getattr(tokenizer, "special_tokens_map", {}), **template_kwargs})
    variables.update(messages=chat, tools=_plain(tools), documents=None, add_generation_prompt=add_generation_prompt)
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return render_template(source, variables, name=name, bounds=bounds)


def _with_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """``reasoning_content`` and ``thinking`` filled from whichever reasoning field the message sets."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (as transformers' ``_plain_template_data``; anything else a
    ``<TypeName>`` placeholder), so a template reaches no object's methods but those of JSON values."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"
