"""How the NemoGym actor's stream groups finished rows: one streamed element per window of finished rows."""

from __future__ import annotations

import asyncio
from typing import Any

BATCH_WINDOW_S = 0.5
"""Rows finishing within this window of a finished row travel with it in one streamed element (each element
costs about a millisecond of Ray's CPU on each side, benchmarks/ray_stream_cost.py); the last rows of a call,
and a failure, go at once. What a lost actor takes with it is at most this window's finished rows."""


async def gather_window(
    finished: asyncio.Queue[asyncio.Task[Any]], remaining: int, window_s: float
) -> list[asyncio.Task[Any]]:
    """The next finished task, then those that finish within ``window_s`` of it: until ``remaining`` are in,
    the window closes or a task failed (the watch included)."""
    ready = [await finished.get()]
    loop = asyncio.get_running_loop()
    closes = loop.time() + window_s
    while len(ready) < remaining and not failed(ready[-1]):
        if finished.empty():
            left = closes - loop.time()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    ready.append(await finished.get())
            except TimeoutError:
                break
        else:
            ready.append(finished.get_nowait())
    return ready


def failed(task: asyncio.Task[Any]) -> bool:
    """Whether a finished task was cancelled or raised."""
    return task.cancelled() or task.exception() is not None
