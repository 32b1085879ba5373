"""Reward functions for the VLM environment, and how to run them safely on adversarial text.

Every reward function has the signature ``(ground_truth, response, **kwargs) ->
(score, is_correct | None)``; :data:`REWARD_FUNCTIONS` names them. Parsing uses
``str.find`` / ``rfind`` and regexes without nested quantifiers, so their cost is
linear in the text; :func:`bounded_call` additionally caps the text length and,
on the main thread, the wall time, and turns any failure into a score of 0.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonMapping

logger = logging.getLogger(__name__)

RewardResult = tuple[float, bool | None]
RewardFunction = Callable[..., RewardResult]

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_CHOICE = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """The text between the first ``<tag>`` and the last ``</tag>`` after it, or None."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    start = text.find(open_tag)
    if start < 0:
        return None
    end = text.rfind(close_tag)
    if end < start + len(open_tag):
        return None
    return text[start + len(open_tag) : end]


def format_reward(
    ground_truth: str, response: str, think_tag: str = "think", answer_tag: str = "answer"
) -> RewardResult:
    """+0.25 for a ``<think>…</think>`` block, +0.75 for an ``<answer>…</answer>`` block."""
    score = 0.0
    if extract_tag(response, think_tag) is not None:
        score += 0.25
    if extract_tag(response, answer_tag) is not None:
        score += 0.75
    return score, None


def _alnum(text: str) -> str:
    return "".join(c for c in text if c.isalnum()).lower()


def exact_alnum_reward(ground_truth: str, response: str, answer_tag: str = "answer") -> RewardResult:
    """1 when the answer's alphanumerics, lowercased, equal the ground truth's."""
    answer = extract_tag(response, answer_tag)
    correct = answer is not None and _alnum(answer) == _alnum(str(ground_truth))
    return (1.0 if correct else 0.0), correct


def multiple_choice_reward(ground_truth: str, response: str, answer_tag: str = "answer") -> RewardResult:
    """1 when the only capital letter standing alone in the answer (e.g. ``(B)``, ``B.``) is the ground truth's."""
    answer = extract_tag(response, answer_tag)
    expected = _CHOICE.findall(str(ground_truth).strip().upper())
    if answer is None or len(expected) != 1:
        return 0.0, False
    letters = set(_CHOICE.findall(answer.strip()))
    correct = letters == {expected[0]}
    return (1.0 if correct else 0.0), correct


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric_reward(
    ground_truth: str, response: str, rel_tol: float = 1e-4, abs_tol: float = 1e-6, answer_tag: str = "answer"
) -> RewardResult:
    """1 when the last number in the answer is within tolerance of the ground truth's number."""
    answer = extract_tag(response, answer_tag)
    expected = _last_number(str(ground_truth))
    got = _last_number(answer) if answer is not None else None
    correct = got is not None and expected is not None and math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    return (1.0 if correct else 0.0), correct


def _box(text: str) -> tuple[float, float, float, float] | None:
    values = [float(v) for v in _NUMBER.findall(text.replace("[", " ").replace("]", " "))]
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        return None
    x1, y1, x2, y2 = values
    return (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))


def _area(box: tuple[float, float, float, float]) -> float:
    return (box[2] - box[0]) * (box[3] - box[1])


def bbox_giou_reward(
    ground_truth: str, response: str, giou_penalty_thres: float = 10.0, answer_tag: str = "answer"
) -> RewardResult:
    """IoU of ``x1, y1, x2, y2`` boxes, or GIoU when IoU is below ``giou_penalty_thres``; correct if > 0.5."""
    answer = extract_tag(response, answer_tag)
    pred, gt = (_box(answer) if answer is not None else None), _box(str(ground_truth))
    if pred is None or gt is None:
        return 0.0, False
    ix = max(0.0, min(pred[2], gt[2]) - max(pred[0], gt[0]))
    iy = max(0.0, min(pred[3], gt[3]) - max(pred[1], gt[1]))
    inter = ix * iy
    union = max(_area(pred) + _area(gt) - inter, 1e-3)
    iou = inter / union
    score = iou
    if iou < giou_penalty_thres:
        hull = max((max(pred[2], gt[2]) - min(pred[0], gt[0])) * (max(pred[3], gt[3]) - min(pred[1], gt[1])), 1e-3)
        score = iou - (hull - union) / hull
    return score, score > 0.5


def _boxed(text: str) -> str:
    text = text.strip()
    return text if text.startswith("\\boxed{") else f"\\boxed{{{text}}}"


_MAX_MATH_CHARS = 2_000
"""Longer answers are not graded (0): no real answer is that long, and sympy's cost grows fast."""


def _math_equivalent(ground_truth: str, answer: str) -> float:
    """1.0 when math-verify finds ``answer`` equal to ``ground_truth`` (both boxed LaTeX or expressions).

    math-verify's own signal-based timeouts are off: :func:`bounded_call` holds the time limit.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if len(answer) > _MAX_MATH_CHARS or len(ground_truth) > _MAX_MATH_CHARS:
        return 0.0

    gold = parse(_boxed(ground_truth), extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    pred = parse(
        _boxed(answer), extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=None
    )
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def math_expr_reward(ground_truth: str, response: str, tag: str = "answer") -> RewardResult:
    """1 when the ``<tag>`` content is mathematically equal to the ground truth (math-verify); correct if > 0.1."""
    answer = extract_tag(response, tag)
    if answer is None:
        return 0.0, False
    score = _math_equivalent(str(ground_truth), answer)
    return score, score > 0.1


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces matched, or None (one linear scan)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def geo3k_reward(ground_truth: str, response: str, format_score: float = 0.1) -> RewardResult:
    """Geometry3k: ``(1 - f) * accuracy + f * format``; format = ``</think>`` followed by a ``\\boxed{}``.

    Accuracy grades the last ``\\boxed{}`` with math-verify; correct if accuracy > 0.1.
    """
    think_end = response.find("</think>")
    format_ok = think_end >= 0 and last_boxed(response[think_end:]) is not None
    boxed = last_boxed(response)
    accuracy = _math_equivalent(str(ground_truth), boxed) if boxed is not None else 0.0
    score = (1.0 - format_score) * accuracy + format_score * (1.0 if format_ok else 0.0)
    return score, accuracy > 0.1


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "format": format_reward,
    "exact_alnum": exact_alnum_reward,
    "multiple_choice": multiple_choice_reward,
    "numeric": numeric_reward,
    "bbox_giou": bbox_giou_reward,
    "math_expr": math_expr_reward,
    "geo3k": geo3k_reward,
}


class RewardTimeout(GymBridgeError):
    """A reward function ran past its time limit."""


class NonFiniteScore(GymBridgeError, ValueError):
    """A reward function returned a score that is NaN or infinite."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`RewardTimeout` in the body after ``seconds`` (main thread only; elsewhere no limit).

    Python's regex engine checks for signals while matching, so this interrupts a
    catastrophic backtrack too.
    """
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise RewardTimeout(f"exceeded {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def bounded_call(
    name: str,
    fn: RewardFunction,
    ground_truth: str,
    response: str,
    kwargs: JsonMapping,
    *,
    max_chars: int,
    time_limit_s: float | None,
) -> RewardResult:
    """``fn`` on texts cut to ``max_chars`` (the response keeps its end), under ``time_limit_s``.

    An exception, a timeout or a non-finite score gives ``(0.0, False)`` and a warning.
    """
    try:
        with time_limit(time_limit_s):
            score, correct = fn(str(ground_truth)[:max_chars], response[-max_chars:], **kwargs)
        score = float(score)
        if not math.isfinite(score):
            raise NonFiniteScore(f"non-finite score {score}")
        return score, correct
    except Exception as exc:  # a verifier must never take the environment down
        logger.warning("reward function %r failed (%s: %s); scoring 0", name, type(exc).__name__, exc)
        return 0.0, False
