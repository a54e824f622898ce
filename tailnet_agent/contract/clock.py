"""Time as an injected dependency, shared by the operator and the agent.

Everything in the operator that reads the time or waits goes through a `Clock`: the workqueue's
delays, the token bucket, the informer's backoff, leader election, Events, and the reconcilers'
timestamps (key expiry, condition transitions); in the agent, the targets watcher, the probes,
DNS and the node. It is part of the contract so that neither package imports the other for it.
Tests run on `FakeClock` and assert exact virtual times without sleeping (the seam
controller-runtime's priority queue keeps in its `now`/`tick` fields, trio's `MockClock`).

`now()` is float seconds on a monotonic scale with an arbitrary origin, for durations and
deadlines; `utcnow()` is the wall clock (an aware UTC datetime) for what is written down: status
timestamps, Lease times, key expirations. On `FakeClock` both move together with `advance()`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol, final

__all__ = ["Clock", "FakeClock", "RealClock"]


class Clock(Protocol):
    """A monotonic time source and the matching way to wait."""

    def now(self) -> float:
        """Monotonic seconds; only differences between two readings are meaningful."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once `seconds` have passed on this clock; a non-positive value only yields."""
        ...

    def utcnow(self) -> datetime:
        """The wall-clock time, aware, in UTC."""
        ...


@final
class RealClock:
    """The event loop's clock: `loop.time()` and `asyncio.sleep`.

    Both methods must be called from inside the running loop.
    """

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))

    def utcnow(self) -> datetime:
        return datetime.now(UTC)


@dataclass(order=True)
class _Sleeper:
    deadline: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)


@final
class FakeClock:
    """A clock that only moves when a test calls `advance()`.

    Starts at `start` seconds (default 0.0) and at the wall-clock time `wall` (default
    2026-01-01T00:00:00Z). `sleep()` parks the caller until `advance()` moves the time to or past
    its deadline. Limits: it does not patch `asyncio.sleep` or `loop.time()`, so it only controls
    code that was handed this clock.
    """

    def __init__(self, start: float = 0.0, *, wall: datetime = datetime(2026, 1, 1, tzinfo=UTC)) -> None:
        self._start = start
        self._wall = wall
        self._now = start
        self._sleepers: list[_Sleeper] = []
        self._seq = itertools.count()
        self._sleeper_added = asyncio.Event()

    def now(self) -> float:
        return self._now

    def utcnow(self) -> datetime:
        return self._wall + timedelta(seconds=self._now - self._start)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        sleeper = _Sleeper(self._now + seconds, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._sleepers, sleeper)
        self._sleeper_added.set()
        try:
            await sleeper.future
        finally:
            if not sleeper.future.done():
                sleeper.future.cancel()  # advance() skips it; the heap drops it lazily

    def advance(self, seconds: float) -> None:
        """Move the time forward by `seconds` and wake every sleeper whose deadline has come.

        Sleepers are woken in deadline order (ties: the order they went to sleep), and all of them
        observe the new time when they resume. Raises ValueError for a negative `seconds`.
        """
        if seconds < 0:
            raise ValueError("time can't go backwards")
        self._now += seconds
        while self._sleepers and self._sleepers[0].deadline <= self._now:
            sleeper = heapq.heappop(self._sleepers)
            if not sleeper.future.done():
                sleeper.future.set_result(None)

    @property
    def sleepers(self) -> int:
        """How many tasks are parked in `sleep()` right now."""
        return sum(1 for s in self._sleepers if not s.future.done())

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline among parked sleepers, or None when nobody sleeps."""
        pending = [s.deadline for s in self._sleepers if not s.future.done()]
        return min(pending, default=None)

    async def wait_for_sleepers(self, count: int = 1) -> None:
        """Block until at least `count` tasks are parked in `sleep()`.

        This is how a test knows the code under test has reached its wait before it calls
        `advance()`; it uses no real time, so it hangs (and pytest-timeout fires) if that never
        happens.
        """
        while self.sleepers < count:
            self._sleeper_added.clear()
            await self._sleeper_added.wait()
