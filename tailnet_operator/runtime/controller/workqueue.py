"""Workqueues with client-go's semantics (`util/workqueue`), for asyncio.

Three layers, as in client-go:

- `WorkQueue`: a FIFO of hashable keys plus a *dirty* set (keys that need processing) and a
  *processing* set (keys a worker holds). Adding a dirty key is a no-op, so bursts of events for
  one object collapse into one reconcile. A key re-added while a worker holds it is only queued
  again when the worker calls `done()`, so no key is ever processed by two workers at once.
- `DelayingQueue`: `add_after()` keeps keys in a heap until their ready time; `run()` moves them in.
- `RateLimitingQueue`: `add_rate_limited()` asks a `RateLimiter` for the delay.

This is the classic queue, i.e. controller-runtime with `UsePriorityQueue=false` (whose default
limiter includes the 10 qps bucket). All methods except `get`, `shutdown_with_drain` and `run` are
synchronous; the queue is meant for one event loop and needs no locks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Hashable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tailnet_operator.runtime.clock import Clock, RealClock
from tailnet_operator.runtime.controller.ratelimit import RateLimiter, default_controller_rate_limiter
from tailnet_operator.runtime.metrics import QueueMetrics

__all__ = ["DelayingQueue", "RateLimitingQueue", "ShutDown", "WorkQueue"]

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """Raised by `get()` once the queue is shut down and empty: the worker should return."""


# -------------------------------------------------------------------------------------------------
# Helpers
# -------------------------------------------------------------------------------------------------


class _WaitList:
    """Tasks parked until notified, woken first-in first-out.

    A wake-up that reaches a task which is cancelled before it resumes is passed to the next task,
    so a cancelled `get()` never swallows a key.
    """

    def __init__(self) -> None:
        self._futures: deque[asyncio.Future[None]] = deque()

    async def wait(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.notify_one()
            raise
        finally:
            with suppress(ValueError):
                self._futures.remove(future)

    def notify_one(self) -> None:
        while self._futures:
            future = self._futures.popleft()
            if not future.done():
                future.set_result(None)
                return

    def notify_all(self) -> None:
        while self._futures:
            self.notify_one()


class _Instrumentation(Generic[K]):
    """Per-key timestamps behind the metrics; does nothing when `metrics` is None."""

    def __init__(self, metrics: QueueMetrics | None, clock: Clock) -> None:
        self._metrics = metrics
        self._clock = clock
        self._added_at: dict[K, float] = {}
        self._started_at: dict[K, float] = {}

    def added(self, key: K) -> None:
        if self._metrics is None:
            return
        self._metrics.adds.inc()
        self._metrics.depth.inc()
        self._added_at.setdefault(key, self._clock.now())

    def handed_out(self, key: K) -> None:
        if self._metrics is None:
            return
        now = self._clock.now()
        self._metrics.depth.dec()
        self._started_at[key] = now
        if (added_at := self._added_at.pop(key, None)) is not None:
            self._metrics.queue_duration.observe(now - added_at)

    def finished(self, key: K) -> None:
        if self._metrics is None:
            return
        if (started_at := self._started_at.pop(key, None)) is not None:
            self._metrics.work_duration.observe(self._clock.now() - started_at)

    def retried(self) -> None:
        if self._metrics is not None:
            self._metrics.retries.inc()

    def update_unfinished_work(self) -> None:
        if self._metrics is None:
            return
        now = self._clock.now()
        ages = [now - started_at for started_at in self._started_at.values()]
        self._metrics.unfinished_work.set(sum(ages))
        self._metrics.longest_running_processor.set(max(ages, default=0.0))


# -------------------------------------------------------------------------------------------------
# WorkQueue
# -------------------------------------------------------------------------------------------------


class WorkQueue(Generic[K]):
    """A deduplicating FIFO of keys; see the module docstring for the dirty/processing rules.

    `clock` defaults to the event loop's clock and is only read for metrics here. `metrics`
    (default None: record nothing) is usually `WorkqueueMetrics.for_queue(name)`.
    """

    def __init__(self, *, clock: Clock | None = None, metrics: QueueMetrics | None = None) -> None:
        self._clock: Clock = clock or RealClock()
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._shutting_down = False
        self._drain = False
        self._getters = _WaitList()
        self._drainers = _WaitList()
        self._instrumentation = _Instrumentation[K](metrics, self._clock)

    def add(self, key: K) -> None:
        """Mark `key` as needing processing. Ignored after shutdown and while `key` is already dirty."""
        if self._shutting_down or key in self._dirty:
            return
        self._instrumentation.added(key)
        self._dirty.add(key)
        if key in self._processing:
            return  # done() queues it again
        self._queue.append(key)
        self._getters.notify_one()

    async def get(self) -> K:
        """Wait for a key and hand it out; the caller must call `done(key)` when finished with it.

        After shutdown the keys still queued are handed out; then ShutDown is raised.
        """
        while not self._queue and not self._shutting_down:
            await self._getters.wait()
        if not self._queue:
            raise ShutDown
        key = self._queue.popleft()
        self._instrumentation.handed_out(key)
        self._processing.add(key)
        self._dirty.discard(key)
        return key

    def done(self, key: K) -> None:
        """Release `key`; if it was added meanwhile, queue it again (even during shutdown).

        Raises ValueError for a key that `get()` did not hand out, or that was already released:
        client-go would queue such a key twice.
        """
        if key not in self._processing:
            raise ValueError(f"done() for a key that is not being processed: {key!r}")
        self._instrumentation.finished(key)
        self._processing.remove(key)
        if key in self._dirty:
            self._queue.append(key)
            self._getters.notify_one()
        if not self._processing:
            self._drainers.notify_all()

    def len(self) -> int:
        """Keys waiting to be handed out (not those being processed). For information only."""
        return len(self._queue)

    @property
    def shutting_down(self) -> bool:
        """True once `shutdown()` or `shutdown_with_drain()` was called."""
        return self._shutting_down

    def shutdown(self) -> None:
        """Ignore new keys and wake all blocked getters; a pending `shutdown_with_drain` stops waiting.

        Workers still receive the keys already queued, then ShutDown. Safe to call more than once.
        """
        self._drain = False
        self._begin_shutdown()
        self._drainers.notify_all()

    async def shutdown_with_drain(self) -> None:
        """Like `shutdown()`, then wait until every key being processed is `done()`.

        It waits for in-flight keys only, as client-go does, not for keys still queued. A later
        `shutdown()` makes it return early. If a worker never calls `done()`, this never returns.
        """
        self._drain = True
        self._begin_shutdown()
        while self._processing and self._drain:
            await self._drainers.wait()

    def update_unfinished_work(self) -> None:
        """Refresh the unfinished-work and longest-running gauges from the keys being processed.

        Called every 500 ms by the controller (client-go's update period); a no-op after shutdown
        or without metrics.
        """
        if not self._shutting_down:
            self._instrumentation.update_unfinished_work()

    def _begin_shutdown(self) -> None:
        self._shutting_down = True
        self._getters.notify_all()


# -------------------------------------------------------------------------------------------------
# DelayingQueue
# -------------------------------------------------------------------------------------------------


@dataclass(order=True)
class _Waiting(Generic[K]):
    ready_at: float
    seq: int  # equal ready times come out in the order they were added
    key: K = field(compare=False)


class DelayingQueue(WorkQueue[K]):
    """A `WorkQueue` that can add a key after a delay.

    The owner must keep `run()` running (in its TaskGroup) for delayed keys to arrive.
    Delayed keys not yet due when the queue shuts down are dropped.
    """

    def __init__(self, *, clock: Clock | None = None, metrics: QueueMetrics | None = None) -> None:
        super().__init__(clock=clock, metrics=metrics)
        self._heap: list[_Waiting[K]] = []
        self._waiting: dict[K, _Waiting[K]] = {}
        self._seq = itertools.count()
        self._wakeup: asyncio.Future[None] | None = None
        self._running = False

    def add_after(self, key: K, seconds: float) -> None:
        """Add `key` once `seconds` have passed on the clock; non-positive means now.

        A key already waiting keeps the earlier of the two ready times. Every call that is not
        ignored by shutdown counts as a retry in the metrics, even with no delay (client-go).
        """
        if self._shutting_down:
            return
        self._instrumentation.retried()
        if seconds <= 0:
            self.add(key)
            return
        ready_at = self._clock.now() + seconds
        existing = self._waiting.get(key)
        if existing is not None and existing.ready_at <= ready_at:
            return
        entry = _Waiting(ready_at, next(self._seq), key)
        self._waiting[key] = entry  # a replaced entry stays in the heap, stale, until _peek drops it
        heapq.heappush(self._heap, entry)
        self._wake_loop()

    async def run(self) -> None:
        """Move delayed keys into the queue when they are due; blocks until the queue shuts down."""
        if self._running:
            raise RuntimeError("run() is already running")
        self._running = True
        try:
            while not self._shutting_down:
                self._add_ready()
                self._wakeup = asyncio.get_running_loop().create_future()
                await self._sleep_until_next(self._wakeup)
        finally:
            self._running = False
            self._wakeup = None

    def _add_ready(self) -> None:
        now = self._clock.now()
        while (entry := self._peek()) is not None and entry.ready_at <= now:
            heapq.heappop(self._heap)
            del self._waiting[entry.key]
            self.add(entry.key)

    def _peek(self) -> _Waiting[K] | None:
        """The earliest live entry, after dropping stale ones from the top of the heap."""
        while self._heap and self._waiting.get(self._heap[0].key) is not self._heap[0]:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    async def _sleep_until_next(self, wakeup: asyncio.Future[None]) -> None:
        """Wait until the earliest key is due, or `wakeup` fires (new key or shutdown)."""
        entry = self._peek()
        if entry is None:
            await wakeup
            return
        sleeper = asyncio.ensure_future(self._clock.sleep(entry.ready_at - self._clock.now()))
        try:
            await asyncio.wait((sleeper, wakeup), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()

    def _wake_loop(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _begin_shutdown(self) -> None:
        super()._begin_shutdown()
        self._heap.clear()
        self._waiting.clear()
        self._wake_loop()


# -------------------------------------------------------------------------------------------------
# RateLimitingQueue
# -------------------------------------------------------------------------------------------------


class RateLimitingQueue(DelayingQueue[K]):
    """A `DelayingQueue` whose retries are spaced by a `RateLimiter`.

    `rate_limiter` defaults to `default_controller_rate_limiter()` on the same clock. Call
    `forget(key)` once a key succeeds, or its backoff keeps growing and is never freed.
    """

    def __init__(
        self,
        *,
        rate_limiter: RateLimiter[K] | None = None,
        clock: Clock | None = None,
        metrics: QueueMetrics | None = None,
    ) -> None:
        super().__init__(clock=clock, metrics=metrics)
        if rate_limiter is None:
            rate_limiter = default_controller_rate_limiter(clock=self._clock)
        self._rate_limiter: RateLimiter[K] = rate_limiter

    def add_rate_limited(self, key: K) -> None:
        """Add `key` after the delay the rate limiter gives it (which counts as one more requeue)."""
        self.add_after(key, self._rate_limiter.when(key))

    def forget(self, key: K) -> None:
        """Stop tracking `key`'s failures, so its next rate-limited add starts from the base delay."""
        self._rate_limiter.forget(key)

    def num_requeues(self, key: K) -> int:
        """How many rate-limited adds `key` had since the last `forget`."""
        return self._rate_limiter.num_requeues(key)
