"""Rate limiters that decide how long a failed key waits before it is retried.

These mirror client-go's `util/workqueue/default_rate_limiters.go`. A limiter is asked once per
retry (`when`), told when a key stopped failing (`forget`), and reports how often a key has been
retried (`num_requeues`). All delays are float seconds.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar, final

from tailnet_operator.runtime.clock import Clock, RealClock

__all__ = [
    "BucketRateLimiter",
    "ItemExponentialFailureRateLimiter",
    "MaxOfRateLimiter",
    "RateLimiter",
    "TokenBucket",
    "default_controller_rate_limiter",
]

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


class RateLimiter(Protocol[K_contra]):
    """Decides retry delays. Implementations may keep per-key state until `forget`."""

    def when(self, key: K_contra) -> float:
        """Seconds `key` must wait before its next retry. Counts as one retry."""
        ...

    def forget(self, key: K_contra) -> None:
        """Drop what is tracked for `key`, whether it finally succeeded or was given up on."""
        ...

    def num_requeues(self, key: K_contra) -> int:
        """How many times `when` was called for `key` since the last `forget`."""
        ...


@final
class ItemExponentialFailureRateLimiter(Generic[K]):
    """Per-key exponential backoff: `base_delay * 2**failures`, capped at `max_delay`.

    `failures` is read before it is incremented, so the first delay is `base_delay`. Defaults:
    base_delay 0.005 s (5 ms), max_delay 1000.0 s, as in client-go's default controller limiter.
    Callers must `forget` keys, or the failure counts are kept forever.
    """

    def __init__(self, base_delay: float = 0.005, max_delay: float = 1000.0) -> None:
        if base_delay < 0 or max_delay < 0:
            raise ValueError("delays must not be negative")
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._failures: dict[K, int] = {}

    def when(self, key: K) -> float:
        exponent = self._failures.get(key, 0)
        self._failures[key] = exponent + 1
        try:
            backoff = math.ldexp(self._base_delay, exponent)
        except OverflowError:  # after ~1000 failures; the cap applies anyway
            return self._max_delay
        return min(backoff, self._max_delay)

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)

    def num_requeues(self, key: K) -> int:
        return self._failures.get(key, 0)


@final
class TokenBucket:
    """A bucket of at most `burst` tokens refilled at `qps` tokens per second (`golang.org/x/time/rate`).

    It starts full. Times are the caller's monotonic seconds. `reserve` always takes a token and may
    drive the balance negative (the answer is how long to wait for it); `take` takes one only if
    there is one. The one token bucket of the runtime: the retry limiter and the Event spam filter.
    """

    def __init__(self, qps: float, burst: int) -> None:
        self.qps = qps
        self.burst = burst
        self.tokens = float(burst)
        self._last: float | None = None  # time of the last refill; None: full since forever

    def _refill(self, now: float) -> None:
        elapsed = 0.0 if self._last is None else max(now - self._last, 0.0)
        self.tokens = min(self.tokens + elapsed * self.qps, float(self.burst))
        self._last = now

    def reserve(self, now: float) -> float:
        """Take a token; seconds until it is really there (0.0 when it was)."""
        self._refill(now)
        self.tokens -= 1.0
        return -self.tokens / self.qps if self.tokens < 0 else 0.0

    def take(self, now: float) -> bool:
        """Take a token if one is there; False leaves the balance as it was."""
        self._refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@final
class BucketRateLimiter(Generic[K]):
    """One token bucket shared by all keys, with the reservation semantics of `golang.org/x/time/rate`.

    The bucket starts full with `burst` tokens (default 100) and refills at `qps` tokens per second
    (default 10.0). Every `when` takes a token even if none is left: the balance goes negative and
    the returned delay is how long the refill takes to cover it, so callers queue up behind each
    other at 1/qps spacing. `qps=math.inf` disables the limit. Keys are ignored, so `forget` does
    nothing and `num_requeues` is always 0.
    """

    def __init__(self, qps: float = 10.0, burst: int = 100, *, clock: Clock | None = None) -> None:
        if not qps > 0:
            raise ValueError(f"qps must be positive, got {qps}")
        if burst < 1:
            raise ValueError(f"burst must be at least 1, got {burst}")
        self._clock: Clock = clock or RealClock()
        self._bucket = TokenBucket(qps, burst)

    def when(self, key: K) -> float:
        if math.isinf(self._bucket.qps):
            return 0.0
        return self._bucket.reserve(self._clock.now())

    def forget(self, key: K) -> None:
        pass

    def num_requeues(self, key: K) -> int:
        return 0


@final
class MaxOfRateLimiter(Generic[K]):
    """Asks every limiter and waits for the slowest, so each of them sees every retry.

    `num_requeues` is the largest count any limiter reports; `forget` is passed to all of them.
    """

    def __init__(self, *limiters: RateLimiter[K]) -> None:
        if not limiters:
            raise ValueError("MaxOfRateLimiter needs at least one limiter")
        self._limiters = limiters

    def when(self, key: K) -> float:
        return max(limiter.when(key) for limiter in self._limiters)

    def forget(self, key: K) -> None:
        for limiter in self._limiters:
            limiter.forget(key)

    def num_requeues(self, key: K) -> int:
        return max(limiter.num_requeues(key) for limiter in self._limiters)


def default_controller_rate_limiter(*, clock: Clock | None = None) -> MaxOfRateLimiter[K]:
    """controller-runtime's default for the classic (non-priority) queue.

    The max of a per-key exponential backoff (5 ms doubling up to 1000 s) and an overall bucket of
    10 qps with a burst of 100, which only bounds the retry rate across all keys. `clock` defaults
    to the event loop's clock.
    """
    return MaxOfRateLimiter[K](
        ItemExponentialFailureRateLimiter[K](0.005, 1000.0),
        BucketRateLimiter[K](10.0, 100, clock=clock),
    )
