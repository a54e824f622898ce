"""Rate limiters on a fake clock: exact delays, as client-go computes them."""

from __future__ import annotations

import math

import pytest

from tailnet_operator.runtime.clock import FakeClock
from tailnet_operator.runtime.controller.ratelimit import (
    BucketRateLimiter,
    ItemExponentialFailureRateLimiter,
    MaxOfRateLimiter,
    RateLimiter,
    default_controller_rate_limiter,
)

# 5 ms doubling per failure; 2**18 * 5 ms = 1310.72 s is the first value over the 1000 s cap.
DEFAULT_BACKOFF = [
    0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
    5.12, 10.24, 20.48, 40.96, 81.92, 163.84, 327.68, 655.36, 1000.0, 1000.0,
]  # fmt: skip


def test_default_limiter_backs_off_exponentially_per_key_up_to_1000s() -> None:
    limiter: RateLimiter[str] = default_controller_rate_limiter(clock=FakeClock())

    delays = [limiter.when("a") for _ in DEFAULT_BACKOFF]

    assert delays == DEFAULT_BACKOFF
    assert limiter.num_requeues("a") == len(DEFAULT_BACKOFF)


def test_forget_restarts_the_backoff_from_the_base_delay() -> None:
    limiter: RateLimiter[str] = default_controller_rate_limiter(clock=FakeClock())
    for _ in range(5):
        limiter.when("a")

    limiter.forget("a")

    assert limiter.num_requeues("a") == 0
    assert limiter.when("a") == 0.005


def test_exponential_backoff_is_tracked_per_key() -> None:
    limiter = ItemExponentialFailureRateLimiter[str]()
    limiter.when("a")
    limiter.when("a")

    assert limiter.when("b") == 0.005
    assert limiter.when("a") == 0.02
    assert (limiter.num_requeues("a"), limiter.num_requeues("b")) == (3, 1)


def test_exponential_backoff_survives_float_overflow() -> None:
    limiter = ItemExponentialFailureRateLimiter[str](base_delay=1.0, max_delay=math.inf)

    delays = [limiter.when("a") for _ in range(1100)]

    assert delays[1023] == 2.0**1023
    assert delays[1024:] == [math.inf] * 76


def test_bucket_allows_the_burst_then_spaces_calls_at_one_over_qps() -> None:
    limiter = BucketRateLimiter[str](qps=10, burst=100, clock=FakeClock())

    delays = [limiter.when(f"key-{i}") for i in range(103)]

    assert delays[:100] == [0.0] * 100
    assert delays[100:] == [0.1, 0.2, 0.3]  # each call queues behind the previous reservation


def test_bucket_refills_with_time_and_caps_at_the_burst() -> None:
    clock = FakeClock()
    limiter = BucketRateLimiter[str](qps=10, burst=100, clock=clock)
    for _ in range(100):
        limiter.when("a")

    spaced = []
    for _ in range(3):
        spaced.append(limiter.when("a"))
        clock.advance(0.1)
    clock.advance(3600)

    assert spaced == pytest.approx([0.1, 0.1, 0.1], abs=1e-9)
    assert [limiter.when("a") for _ in range(101)] == [0.0] * 100 + [pytest.approx(0.1, abs=1e-9)]


def test_bucket_ignores_keys() -> None:
    limiter = BucketRateLimiter[str](qps=1, burst=1, clock=FakeClock())
    limiter.when("a")
    limiter.forget("a")

    assert limiter.when("b") == 1.0
    assert limiter.num_requeues("b") == 0


def test_bucket_with_infinite_qps_never_waits() -> None:
    limiter = BucketRateLimiter[str](qps=math.inf, burst=1, clock=FakeClock())

    assert [limiter.when("a") for _ in range(5)] == [0.0] * 5


@pytest.mark.parametrize(("qps", "burst"), [(0, 1), (-1, 1), (10, 0)])
def test_bucket_rejects_limits_that_would_block_forever(qps: float, burst: int) -> None:
    with pytest.raises(ValueError):
        BucketRateLimiter[str](qps=qps, burst=burst, clock=FakeClock())


def test_max_of_waits_for_the_slowest_and_asks_every_limiter() -> None:
    limiter = MaxOfRateLimiter[str](
        ItemExponentialFailureRateLimiter(base_delay=1.0, max_delay=100.0),
        BucketRateLimiter(qps=1, burst=1, clock=FakeClock()),
    )

    # exponential 1, 2, 4 for "a" then 1 for "b"; the shared bucket says 0, 1, 2, 3
    delays = [limiter.when(key) for key in ("a", "a", "a", "b")]

    assert delays == [1.0, 2.0, 4.0, 3.0]
    assert limiter.num_requeues("a") == 3
    limiter.forget("a")
    assert limiter.num_requeues("a") == 0
    assert limiter.when("a") == 4.0  # backoff restarted at 1 s; the bucket is 4 reservations deep


def test_max_of_needs_a_limiter() -> None:
    with pytest.raises(ValueError):
        MaxOfRateLimiter[str]()
