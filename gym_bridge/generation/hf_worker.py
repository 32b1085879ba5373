"""The worker thread of :class:`~gym_bridge.generation.hf.HFGeneration` and how rows get back to the event loop.

The worker decodes continuously: whatever was queued joins the running batch at the
next step (unless a weight refit is waiting, which pauses admission until the batch
has drained), and each finished row is handed back to its waiter's event loop.

``HFGenerationConfig.num_threads`` gives the worker a torch thread count of its own (default: the process's, which
is one per core unless ``OMP_NUM_THREADS`` says otherwise). On 2 cores, 2 threads decode 1.1-1.4x faster than 1 at
8-32 rows when the machine is otherwise quiet, and as fast at 1 row; with a busy neighbour (other processes' work, at
load averages of 8 and more) a step's hundreds of small parallel regions each wait for a descheduled thread, and 1
thread has decoded 3-20x faster than 2 there (``benchmarks/history/2026-11-28-engine-profile.md``). vLLM's CPU worker
always takes one thread per core less one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Final, Protocol

import torch

from gym_bridge.failures import EngineShutDownError
from gym_bridge.generation.decode_row import Row, RowResult
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.hf_decode import RunningBatch

logger = logging.getLogger("gym_bridge.generation.hf")


class Signal(Enum):
    """Queue sentinels: stop the worker; wake it to look at the refit flag again."""

    STOP = "stop"
    WAKE = "wake"


STOP: Final = Signal.STOP
WAKE: Final = Signal.WAKE

#: What the worker's queue holds: rows to decode, and signals.
type WorkItem = Row | Signal


class WorkerEngine(Protocol):
    """What the worker thread reads of its HFGeneration (held by a weak reference, so a dropped engine stops it)."""

    cfg: HFGenerationConfig
    _pause: threading.Event
    _drained: threading.Event
    _closed: bool
    _rows_running: int
    _rows_pending: int

    def _admit_and_step(self, batch: RunningBatch | None, pending: list[Row]) -> RunningBatch | None: ...


def start_worker(
    engine_ref: weakref.ref[WorkerEngine], q: queue.SimpleQueue[WorkItem], threads: int | None
) -> threading.Thread:
    """Start the worker thread, decoding with ``threads`` torch threads (None: the process default, untouched); every
    other thread keeps its count.

    torch keeps a thread count per thread (OpenMP's and MKL's settings are per thread) and a process default that a
    thread takes at its first parallel operation. The worker sets and takes its own count before this returns; then
    the process default goes back to what it was, so a trainer in the same process and threads started later keep
    theirs.
    """
    ready = threading.Event()
    previous = torch.get_num_threads()
    worker = threading.Thread(
        target=worker_loop, args=(engine_ref, q, threads, ready), name="hf-generation-worker", daemon=True
    )
    worker.start()
    ready.wait()
    if threads is not None:
        torch.set_num_threads(previous)
    return worker


def worker_loop(
    engine_ref: weakref.ref[WorkerEngine],
    q: queue.SimpleQueue[WorkItem],
    threads: int | None = None,
    ready: threading.Event | None = None,
) -> None:
    """The worker thread of an HFGeneration: take queued rows, admit them, step the running batch.

    ``threads``: this thread's torch thread count (None: the process default); ``ready`` is set once it holds it."""
    if threads is not None:
        torch.set_num_threads(threads)
        torch.get_num_threads()  # this thread takes its count now, before start_worker restores the default
    if ready is not None:
        ready.set()
    pending: list[Row] = []
    batch: RunningBatch | None = None
    stopping = False
    while not stopping:
        engine = engine_ref()
        if engine is None:
            break
        idle = batch is None and (not pending or engine._pause.is_set())
        if idle and engine._pause.is_set():
            engine._drained.set()
        wait_s = engine.cfg.batch_wait_s
        publish_counts(engine, batch, pending)
        del engine
        if idle:
            item = q.get()
            if item is STOP:
                break
            if isinstance(item, Row):
                pending.append(item)
                if wait_s > 0:
                    threading.Event().wait(wait_s)  # let concurrent submitters start together
        while True:  # take whatever else is queued
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if item is STOP:
                stopping = True
                break
            if isinstance(item, Row):
                pending.append(item)
        if stopping:
            break
        pending = [r for r in pending if not r.cancelled]
        engine = engine_ref()
        if engine is None or engine._closed:
            break
        try:
            batch = engine._admit_and_step(batch, pending)
        except Exception as exc:  # _admit_and_step has handed the failure to every row of the batch
            if not isinstance(exc, EngineShutDownError):
                logger.exception("HFGeneration batch failed")
            batch = None
        finally:
            publish_counts(engine, batch, pending)
            del engine
    engine = engine_ref()
    if engine is not None:
        publish_counts(engine, None, [])
        del engine
    err = EngineShutDownError("HFGeneration was shut down")
    for row in pending + (batch.rows if batch is not None else []):
        if row.deliver is not None and not row.cancelled:
            row.deliver(err)
    fail_queued(q, err)


def publish_counts(
    engine: WorkerEngine, batch: RunningBatch | None, pending: list[Row], joining: Sequence[Row] = ()
) -> None:
    """The worker's rows decoding (with ``joining``, the rows being prefilled into the batch, as vLLM counts a
    scheduled prefill) and rows taken off the queue but not admitted, for the engine's gauges (two int stores: a
    reader on another thread sees each whole, at most one worker turn old)."""
    engine._rows_running = (len(batch) if batch is not None else 0) + len(joining)
    engine._rows_pending = sum(1 for row in pending if not row.cancelled)


def fail_queued(q: queue.SimpleQueue[WorkItem], err: BaseException) -> None:
    """Fail every row still queued with ``err``."""
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, Row) and item.deliver is not None:
            item.deliver(err)


def make_deliver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[RowResult]
) -> Callable[[RowResult | BaseException], None]:
    """A thread-safe callback that resolves ``fut`` on ``loop`` with a result or an exception."""

    def deliver(result: RowResult | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_resolve, fut, result)

    return deliver


def _resolve(fut: asyncio.Future[RowResult], result: RowResult | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
