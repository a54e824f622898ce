"""Workqueue semantics (client-go `util/workqueue`) on a fake clock; no test sleeps in real time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from prometheus_client import CollectorRegistry

from tailnet_operator.runtime.clock import FakeClock
from tailnet_operator.runtime.controller.ratelimit import BucketRateLimiter
from tailnet_operator.runtime.controller.workqueue import DelayingQueue, RateLimitingQueue, ShutDown, WorkQueue
from tailnet_operator.runtime.metrics import QueueMetrics, WorkqueueMetrics

LABELS = {"name": "things", "controller": "things"}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> QueueMetrics:
    return WorkqueueMetrics(registry=registry).for_queue("things")


def sample(registry: CollectorRegistry, name: str, **extra: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **extra})


async def yield_to_others() -> None:
    """Let every task that is ready run one step; takes no time on any clock."""
    await asyncio.sleep(0)


@asynccontextmanager
async def running(queue: DelayingQueue[str]) -> AsyncIterator[None]:
    """Run the queue's delay loop in a TaskGroup for the block, then shut the queue down."""
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(queue.run())
        try:
            yield
        finally:
            queue.shutdown()


# -------------------------------------------------------------------------------------------------
# FakeClock
# -------------------------------------------------------------------------------------------------


async def test_fake_clock_wakes_sleepers_in_deadline_order(clock: FakeClock) -> None:
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    async with asyncio.TaskGroup() as tasks:
        for name, seconds in [("late", 3.0), ("early", 1.0), ("never", 10.0)]:
            tasks.create_task(sleeper(name, seconds))
        await clock.wait_for_sleepers(3)
        assert clock.next_deadline == 1.0

        clock.advance(5.0)
        await yield_to_others()

        assert woke == [("early", 5.0), ("late", 5.0)]
        assert clock.sleepers == 1
        clock.advance(5.0)


def test_fake_clock_refuses_to_go_backwards(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="time can't go backwards"):
        clock.advance(-0.001)
    assert clock.now() == 0.0


# -------------------------------------------------------------------------------------------------
# WorkQueue
# -------------------------------------------------------------------------------------------------


async def test_repeated_adds_collapse_and_order_is_fifo() -> None:
    queue = WorkQueue[str]()
    for key in ["a", "b", "a", "c", "b", "a"]:
        queue.add(key)

    assert queue.len() == 3
    assert [await queue.get() for _ in range(3)] == ["a", "b", "c"]
    assert queue.len() == 0


async def test_key_added_while_processing_is_delivered_once_after_done() -> None:
    queue = WorkQueue[str]()
    queue.add("a")
    assert await queue.get() == "a"
    second_worker = asyncio.create_task(queue.get())
    await yield_to_others()

    queue.add("a")
    queue.add("a")
    await yield_to_others()

    assert queue.len() == 0
    assert not second_worker.done()  # "a" is held by the first worker
    queue.done("a")
    assert await second_worker == "a"
    assert queue.len() == 0  # the two adds collapsed into one delivery
    queue.done("a")
    assert queue.len() == 0


async def test_done_for_a_key_not_being_processed_is_an_error() -> None:
    queue = WorkQueue[str]()
    queue.add("a")

    with pytest.raises(ValueError, match="not being processed"):
        queue.done("a")
    await queue.get()
    queue.done("a")
    with pytest.raises(ValueError):
        queue.done("a")


async def test_a_wakeup_given_to_a_cancelled_getter_goes_to_the_next_one() -> None:
    queue = WorkQueue[str]()
    first, second = asyncio.create_task(queue.get()), asyncio.create_task(queue.get())
    await yield_to_others()

    queue.add("a")  # wakes `first`...
    first.cancel()  # ...which is cancelled before it runs

    assert await second == "a"
    assert first.cancelled()


async def test_shutdown_wakes_every_blocked_getter() -> None:
    queue = WorkQueue[str]()
    getters = [asyncio.create_task(queue.get()) for _ in range(3)]
    await yield_to_others()

    queue.shutdown()
    results = await asyncio.gather(*getters, return_exceptions=True)

    assert [type(result) for result in results] == [ShutDown] * 3
    assert queue.shutting_down


async def test_after_shutdown_queued_keys_drain_and_new_keys_are_ignored() -> None:
    queue = WorkQueue[str]()
    queue.add("a")
    queue.add("b")

    queue.shutdown()
    queue.add("c")

    assert [await queue.get(), await queue.get()] == ["a", "b"]
    with pytest.raises(ShutDown):
        await queue.get()


async def test_shutdown_with_drain_waits_for_keys_in_flight() -> None:
    queue = WorkQueue[str]()
    queue.add("a")
    queue.add("b")
    await queue.get()
    await queue.get()

    drain = asyncio.create_task(queue.shutdown_with_drain())
    await yield_to_others()
    queue.done("a")
    await yield_to_others()
    assert not drain.done()

    queue.done("b")
    await drain
    with pytest.raises(ShutDown):
        await queue.get()


async def test_shutdown_with_drain_redelivers_a_key_dirtied_while_in_flight() -> None:
    queue = WorkQueue[str]()
    queue.add("a")
    await queue.get()
    queue.add("a")

    drain = asyncio.create_task(queue.shutdown_with_drain())
    await yield_to_others()
    queue.done("a")

    await drain  # nothing is in flight any more
    assert await queue.get() == "a"  # client-go re-queues a dirty key on done, even when shutting down


async def test_shutdown_stops_a_pending_drain() -> None:
    queue = WorkQueue[str]()
    queue.add("a")
    await queue.get()
    drain = asyncio.create_task(queue.shutdown_with_drain())
    await yield_to_others()

    queue.shutdown()

    await drain  # returns although "a" was never done
    queue.done("a")


# -------------------------------------------------------------------------------------------------
# DelayingQueue
# -------------------------------------------------------------------------------------------------


async def test_delayed_keys_arrive_in_ready_time_order(clock: FakeClock) -> None:
    queue = DelayingQueue[str](clock=clock)
    async with running(queue):
        queue.add_after("a", 3.0)
        queue.add_after("b", 1.0)
        queue.add_after("c", 2.0)
        queue.add_after("d", 2.0)
        await clock.wait_for_sleepers(1)
        assert (queue.len(), clock.next_deadline) == (0, 1.0)

        clock.advance(1.5)
        assert await queue.get() == "b"
        await clock.wait_for_sleepers(1)
        assert (queue.len(), clock.next_deadline) == (0, 2.0)

        clock.advance(10.0)
        assert [await queue.get() for _ in range(3)] == ["c", "d", "a"]  # equal times: first added first


@pytest.mark.parametrize(("first", "second"), [(5.0, 2.0), (2.0, 5.0)])
async def test_a_key_delayed_twice_arrives_once_at_the_earlier_time(
    clock: FakeClock, first: float, second: float
) -> None:
    queue = DelayingQueue[str](clock=clock)
    async with running(queue):
        queue.add_after("x", first)
        queue.add_after("x", second)
        queue.add_after("sentinel", 6.0)

        await clock.wait_for_sleepers(1)
        assert clock.next_deadline == 2.0
        clock.advance(2.0)
        assert await queue.get() == "x"
        queue.done("x")
        await clock.wait_for_sleepers(1)  # the loop is parked until the sentinel is due

        clock.advance(8.0)
        assert await queue.get() == "sentinel"
        assert queue.len() == 0  # no second "x" at t=5


async def test_an_earlier_delay_for_a_waiting_key_wakes_the_loop_early(clock: FakeClock) -> None:
    queue = DelayingQueue[str](clock=clock)
    async with running(queue):
        queue.add_after("x", 100.0)
        await clock.wait_for_sleepers(1)

        queue.add_after("x", 1.0)
        clock.advance(1.0)

        assert await queue.get() == "x"  # without the wake-up the loop would sleep until t=100
        assert clock.now() == 1.0


async def test_non_positive_delay_adds_at_once_without_the_loop(clock: FakeClock) -> None:
    queue = DelayingQueue[str](clock=clock)

    queue.add_after("a", 0.0)
    queue.add_after("b", -1.0)

    assert queue.len() == 2


async def test_shutdown_ends_run_and_drops_waiting_keys(clock: FakeClock) -> None:
    queue = DelayingQueue[str](clock=clock)
    loop = asyncio.create_task(queue.run())
    queue.add_after("a", 1.0)
    await clock.wait_for_sleepers(1)

    queue.shutdown()
    await loop
    queue.add_after("b", 0.0)
    clock.advance(1.0)

    assert queue.len() == 0
    assert clock.sleepers == 0


async def test_run_refuses_to_run_twice(clock: FakeClock) -> None:
    queue = DelayingQueue[str](clock=clock)
    async with running(queue):
        await yield_to_others()
        with pytest.raises(RuntimeError, match="already running"):
            await queue.run()


# -------------------------------------------------------------------------------------------------
# RateLimitingQueue
# -------------------------------------------------------------------------------------------------


async def test_rate_limited_adds_back_off_until_forgotten(clock: FakeClock) -> None:
    queue = RateLimitingQueue[str](clock=clock)  # the default controller limiter
    async with running(queue):
        deadlines = []
        for _ in range(3):
            queue.add_rate_limited("a")
            await clock.wait_for_sleepers(1)
            deadlines.append(clock.next_deadline)
            clock.advance(1.0)
            assert await queue.get() == "a"
            queue.done("a")

        assert deadlines == [0.005, 1.01, 2.02]
        assert queue.num_requeues("a") == 3
        queue.forget("a")
        assert queue.num_requeues("a") == 0


async def test_rate_limited_add_uses_the_given_limiter(clock: FakeClock) -> None:
    queue = RateLimitingQueue[str](clock=clock, rate_limiter=BucketRateLimiter(qps=1, burst=1, clock=clock))

    queue.add_rate_limited("a")
    queue.add_rate_limited("b")

    assert queue.len() == 1  # "b" waits 1 s for a token
    assert queue.num_requeues("b") == 0


# -------------------------------------------------------------------------------------------------
# Metrics
# -------------------------------------------------------------------------------------------------


async def test_series_exist_at_zero_with_controller_runtime_names(
    registry: CollectorRegistry, metrics: QueueMetrics
) -> None:
    names = {s.name for family in registry.collect() for s in family.samples}

    assert sample(registry, "workqueue_depth", priority="") == 0.0
    assert sample(registry, "workqueue_adds_total") == 0.0
    assert sample(registry, "workqueue_retries_total") == 0.0
    assert sample(registry, "workqueue_queue_duration_seconds_bucket", le="1e-08") == 0.0
    assert sample(registry, "workqueue_work_duration_seconds_bucket", le="1000.0") == 0.0
    assert sample(registry, "workqueue_unfinished_work_seconds") == 0.0
    assert sample(registry, "workqueue_longest_running_processor_seconds") == 0.0
    assert not [name for name in names if name.endswith("_created")]


async def test_adds_total_counts_only_adds_of_keys_not_already_dirty(
    registry: CollectorRegistry, metrics: QueueMetrics
) -> None:
    queue = WorkQueue[str](metrics=metrics)
    for key in ["a", "a", "b"]:
        queue.add(key)
    assert sample(registry, "workqueue_adds_total") == 2.0

    await queue.get()
    queue.add("a")  # in flight, so dirty again: counted
    queue.add("a")  # already dirty: not counted

    assert sample(registry, "workqueue_adds_total") == 3.0


async def test_depth_counts_dirty_keys_waiting_for_a_worker(
    registry: CollectorRegistry, metrics: QueueMetrics
) -> None:
    queue = WorkQueue[str](metrics=metrics)

    def depth() -> float | None:
        return sample(registry, "workqueue_depth", priority="")

    queue.add("a")
    queue.add("b")
    assert depth() == 2.0
    assert await queue.get() == "a"
    assert depth() == 1.0
    queue.add("a")  # held by a worker: counted now, queued on done (as client-go does)
    assert (depth(), queue.len()) == (2.0, 1)
    queue.done("a")
    assert (depth(), queue.len()) == (2.0, 2)
    await queue.get()
    await queue.get()
    assert depth() == 0.0


async def test_retries_count_every_delayed_and_rate_limited_add(
    clock: FakeClock, registry: CollectorRegistry, metrics: QueueMetrics
) -> None:
    queue = RateLimitingQueue[str](clock=clock, metrics=metrics)

    queue.add_rate_limited("a")
    queue.add_rate_limited("a")
    queue.add_after("b", 5.0)
    queue.add_after("c", 0.0)
    queue.add("d")
    queue.shutdown()
    queue.add_after("e", 1.0)

    assert sample(registry, "workqueue_retries_total") == 4.0
    assert sample(registry, "workqueue_adds_total") == 2.0  # "c" and "d"; the delayed ones never arrived


async def test_durations_are_measured_on_the_queue_clock(
    clock: FakeClock, registry: CollectorRegistry, metrics: QueueMetrics
) -> None:
    queue = WorkQueue[str](clock=clock, metrics=metrics)
    queue.add("a")
    clock.advance(2.0)
    queue.add("a")  # still dirty: the wait is measured from the first add
    await queue.get()
    clock.advance(30.0)
    queue.done("a")

    assert sample(registry, "workqueue_queue_duration_seconds_sum") == 2.0
    assert sample(registry, "workqueue_queue_duration_seconds_count") == 1.0
    assert sample(registry, "workqueue_work_duration_seconds_sum") == 30.0
    assert sample(registry, "workqueue_work_duration_seconds_bucket", le="10.0") == 0.0
    assert sample(registry, "workqueue_work_duration_seconds_bucket", le="100.0") == 1.0


async def test_unfinished_work_sums_and_maxes_the_ages_of_keys_in_flight(
    clock: FakeClock, registry: CollectorRegistry, metrics: QueueMetrics
) -> None:
    queue = WorkQueue[str](clock=clock, metrics=metrics)
    queue.add("a")
    queue.add("b")
    await queue.get()
    clock.advance(1.0)
    await queue.get()
    clock.advance(2.0)

    queue.update_unfinished_work()

    assert sample(registry, "workqueue_unfinished_work_seconds") == 5.0  # 3 s + 2 s
    assert sample(registry, "workqueue_longest_running_processor_seconds") == 3.0
    queue.done("a")
    queue.done("b")
    queue.update_unfinished_work()
    assert sample(registry, "workqueue_unfinished_work_seconds") == 0.0
    assert sample(registry, "workqueue_longest_running_processor_seconds") == 0.0
