"""Event dedup and the spam filter on a fake clock, with a fake API (no apiserver, no sleeps)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tailnet_operator.runtime.clock import FakeClock
from tailnet_operator.runtime.errors import NotFound, ServerError
from tailnet_operator.runtime.events import (
    REPORTING_CONTROLLER,
    EventKey,
    EventRecorder,
    EventType,
    Outcome,
    SeriesCache,
    SpamFilter,
    event_name,
)
from tailnet_operator.runtime.kinds import Resource

JSON = dict[str, Any]


class FakeEvents:
    """Stores created Events by (namespace, name) and applies series patches; can be made to fail."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], JSON] = {}
        self.calls: list[str] = []
        self.fail_next: Exception | None = None
        self.gate: asyncio.Event | None = None

    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON:
        self.calls.append("create")
        if self.gate is not None:
            await self.gate.wait()
        self._maybe_fail()
        self.events[(str(namespace), body["metadata"]["name"])] = body
        return body

    async def merge_patch(self, resource: Resource, name: str, patch: JSON, namespace: str | None = None,
                          *, subresource: str | None = None) -> JSON:
        self.calls.append("patch")
        self._maybe_fail()
        key = (str(namespace), name)
        if key not in self.events:
            raise NotFound(404, "NotFound", f"events {name} not found")
        self.events[key] = {**self.events[key], **patch}
        return self.events[key]

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc


def configmap(name: str = "cm", uid: str = "uid-1", namespace: str | None = "ns") -> JSON:
    meta: JSON = {"name": name, "uid": uid}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1000.0)


@pytest.fixture
def api() -> FakeEvents:
    return FakeEvents()


@pytest.fixture
def recorder(api: FakeEvents, clock: FakeClock) -> EventRecorder:
    return EventRecorder(api, reporting_instance="me", clock=clock)


# -- the spam filter ----------------------------------------------------------------------------


def test_spam_filter_allows_a_burst_then_one_token_per_refill_interval() -> None:
    spam = SpamFilter(burst=25, qps=1 / 300)
    assert [spam.allow("obj", 0.0) for _ in range(26)] == [True] * 25 + [False]
    assert not spam.allow("obj", 299.0)
    assert spam.allow("obj", 300.0)
    assert not spam.allow("obj", 300.0)


def test_spam_filter_buckets_are_per_key_and_never_exceed_the_burst() -> None:
    spam = SpamFilter(burst=2, qps=1.0)
    assert spam.allow("a", 0.0) and spam.allow("a", 0.0)
    assert spam.allow("b", 0.0), "another object has its own bucket"
    assert [spam.allow("a", 1000.0) for _ in range(3)] == [True, True, False]


def test_spam_filter_forgets_the_least_recently_used_key() -> None:
    spam = SpamFilter(burst=1, qps=0.0, max_keys=2)
    assert spam.allow("a", 0.0) and spam.allow("b", 0.0)
    assert spam.allow("c", 0.0)  # evicts "a"
    assert spam.allow("a", 0.0), "an evicted key starts with a full bucket"
    assert not spam.allow("c", 0.0)


# -- the series cache ---------------------------------------------------------------------------

KEY = EventKey("uid-1", "Normal", "Synced", "Reconcile", "in sync")


def test_series_counts_repeats_within_the_window_from_the_last_occurrence() -> None:
    cache = SeriesCache(window=600.0)
    assert cache.repeat(KEY, 0.0) is None
    cache.start(KEY, "cm.1", "ns", 0.0)
    first = cache.repeat(KEY, 500.0)
    second = cache.repeat(KEY, 1100.0)  # 600 s after the previous occurrence, not the first
    assert first is not None and second is not None
    assert (second.name, second.count) == ("cm.1", 3)
    assert cache.repeat(KEY, 1700.1) is None


def test_series_keys_differ_in_every_field() -> None:
    cache = SeriesCache()
    cache.start(KEY, "cm.1", "ns", 0.0)
    for other in (EventKey("uid-2", "Normal", "Synced", "Reconcile", "in sync"),
                  EventKey("uid-1", "Warning", "Synced", "Reconcile", "in sync"),
                  EventKey("uid-1", "Normal", "Failed", "Reconcile", "in sync"),
                  EventKey("uid-1", "Normal", "Synced", "Delete", "in sync"),
                  EventKey("uid-1", "Normal", "Synced", "Reconcile", "other note")):
        assert cache.repeat(other, 1.0) is None


def test_event_names_stay_valid_for_long_object_names() -> None:
    assert event_name("cm", "00ff") == "cm.00ff"
    long = event_name("a" * 240 + "-b" * 10, "0123456789abcdef")
    assert len(long) <= 253
    assert long.endswith(".0123456789abcdef")
    cut_at_a_dash = event_name("x" * 235 + "-y", "0123456789abcdef")
    assert cut_at_a_dash == "x" * 235 + ".0123456789abcdef", "a label must not end in '-'"


# -- the recorder -------------------------------------------------------------------------------


async def test_five_occurrences_make_one_event_with_series_count_five(
        recorder: EventRecorder, api: FakeEvents, clock: FakeClock) -> None:
    outcomes = []
    for _ in range(5):
        outcomes.append(await recorder.normal(configmap(), "Synced", "in sync"))
        clock.advance(1.0)
    assert outcomes == [Outcome.CREATED] + [Outcome.SERIES] * 4
    assert api.calls == ["create"] + ["patch"] * 4
    ((namespace, name), event), = api.events.items()
    assert namespace == "ns" and name.startswith("cm.")
    assert event["series"]["count"] == 5
    assert event["regarding"] == {"apiVersion": "v1", "kind": "ConfigMap", "name": "cm", "namespace": "ns",
                                  "uid": "uid-1"}
    assert (event["reportingController"], event["reportingInstance"]) == (REPORTING_CONTROLLER, "me")


async def test_a_repeat_after_the_window_starts_a_new_event(
        recorder: EventRecorder, api: FakeEvents, clock: FakeClock) -> None:
    await recorder.normal(configmap(), "Synced", "in sync")
    clock.advance(600.5)
    assert await recorder.normal(configmap(), "Synced", "in sync") is Outcome.CREATED
    assert len(api.events) == 2


async def test_the_spam_filter_counts_repeats_too(recorder: EventRecorder, api: FakeEvents,
                                                  clock: FakeClock) -> None:
    outcomes = [await recorder.warning(configmap(), "Failed", f"attempt {i}") for i in range(30)]
    assert outcomes.count(Outcome.DROPPED) == 5
    assert outcomes[-5:] == [Outcome.DROPPED] * 5
    assert await recorder.warning(configmap(uid="uid-2", name="other"), "Failed", "x") is Outcome.CREATED
    clock.advance(300.0)
    assert await recorder.warning(configmap(), "Failed", "attempt 0") is Outcome.SERIES


async def test_cluster_scoped_objects_get_events_in_default(recorder: EventRecorder, api: FakeEvents) -> None:
    await recorder.normal(configmap(namespace=None), "Synced", "in sync")
    ((namespace, _), event), = api.events.items()
    assert namespace == "default"
    assert "namespace" not in event["regarding"]


async def test_api_errors_are_swallowed_and_the_next_occurrence_retries(
        recorder: EventRecorder, api: FakeEvents) -> None:
    api.fail_next = ServerError(500, "InternalError", "etcd is sad")
    assert await recorder.normal(configmap(), "Synced", "in sync") is Outcome.FAILED
    assert await recorder.normal(configmap(), "Synced", "in sync") is Outcome.CREATED
    api.fail_next = ServerError(500, "InternalError", "etcd is sad")
    assert await recorder.normal(configmap(), "Synced", "in sync") is Outcome.FAILED
    assert await recorder.normal(configmap(), "Synced", "in sync") is Outcome.SERIES
    ((_, event),) = api.events.items()
    assert event["series"]["count"] == 3, "count is the occurrences seen, including one whose patch failed"


async def test_an_expired_event_is_recreated(recorder: EventRecorder, api: FakeEvents) -> None:
    await recorder.normal(configmap(), "Synced", "in sync")
    api.events.clear()  # the apiserver's event TTL ran out
    assert await recorder.normal(configmap(), "Synced", "in sync") is Outcome.CREATED
    ((_, event),) = api.events.items()
    assert "series" not in event


async def test_objects_without_uid_are_dropped_without_raising(recorder: EventRecorder,
                                                                api: FakeEvents) -> None:
    assert await recorder.normal({"kind": "ConfigMap", "metadata": {"name": "x"}}, "R", "n") is Outcome.FAILED
    assert api.calls == []


async def test_long_notes_are_cut_to_1024_bytes(recorder: EventRecorder, api: FakeEvents) -> None:
    await recorder.event(configmap(), EventType.NORMAL, "Synced", "é" * 1000)
    ((_, event),) = api.events.items()
    assert len(event["note"].encode()) <= 1024
    assert event["note"] == "é" * 512


async def test_concurrent_repeats_wait_for_the_create(recorder: EventRecorder, api: FakeEvents) -> None:
    api.gate = asyncio.Event()
    tasks = [asyncio.create_task(recorder.normal(configmap(), "Synced", "in sync")) for _ in range(3)]
    await asyncio.sleep(0)
    assert api.calls == ["create"], "repeats must not patch an Event that is still being created"
    api.gate.set()
    assert await asyncio.gather(*tasks) == [Outcome.CREATED, Outcome.SERIES, Outcome.SERIES]
