"""One bounded shutdown step of an eval run: it finishes through a SIGINT, and its error is logged, not raised."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


@contextmanager
def sigint_deferred(step: str) -> Iterator[None]:
    """One bounded shutdown step: run to the end (a SIGINT meanwhile is logged, not raised), and an
    error is logged, not raised, so the other steps still run and the run's own outcome is kept."""
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: logger.warning("SIGINT: still %s, please wait", step))
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    except Exception:  # see the docstring
        logger.exception("%s failed", step)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
