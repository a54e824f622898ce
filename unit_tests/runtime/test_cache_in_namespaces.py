"""A kind cached in some namespaces only: whole objects there, nothing listed or watched
elsewhere, and an object read elsewhere fetched with GET (its last answer re-read, refreshed in
the background, and its changes told to the handlers of all namespaces)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from tailnet_agent.contract.clock import FakeClock
from tailnet_operator.runtime.cache import FETCH_FORGET, NotYetCached, SharedCache
from tailnet_operator.runtime.cache.informer import DeletedFinalStateUnknown
from tailnet_operator.runtime.controller import Controller, Request, Result
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.runtime.kinds import CONFIG_MAP, SECRET, Resource
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

from .test_cache_by_metadata import read_when_fetched as read

OPERATOR = "tailnet-system"
GATEWAY = "tailnet-gateway"
REFRESH = 10.0


def secret(name: str, namespace: str, value: str, **labels: str) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels}, "data": {"key": value}}


async def until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10):
        while not check():  # noqa: ASYNC110 (polls with a deadline)
            await asyncio.sleep(0.01)


class Counting:
    """The fake's lister-watcher, counting GETs and refusing the namespaces in ``forbidden``."""

    def __init__(self, fake: FakeClient, forbidden: set[str]) -> None:
        self._inner = fake.lister_watcher
        self.forbidden = forbidden
        self.gets: list[str] = []

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON:
        self.gets.append(f"{namespace}/{name}")
        if namespace in self.forbidden:
            raise Forbidden(403, "Forbidden", f"secrets {name!r} is forbidden")
        return await self._inner.get(resource, name, namespace)

    def __getattr__(self, attr: str) -> object:
        return getattr(self._inner, attr)


@dataclass
class Seen:
    """An event handler that records what it is told."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def on_add(self, obj: JSON) -> None:
        self.events.append(("add", obj["metadata"]["name"]))

    def on_update(self, old: JSON, new: JSON) -> None:
        self.events.append(("update", new["metadata"]["name"]))

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        final = obj.obj if isinstance(obj, DeletedFinalStateUnknown) else obj
        self.events.append(("delete", final["metadata"]["name"]))


@dataclass
class Running:
    fake: FakeClient
    client: Counting
    cache: SharedCache
    clock: FakeClock
    seen: Seen


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    fake, clock = FakeClient(), FakeClock()
    client = Counting(fake, forbidden={"closed"})
    cache = SharedCache(client, clock=clock)  # type: ignore[arg-type]  # a ListerWatcher with get()
    cache.cache_in(SECRET, (OPERATOR, GATEWAY), refresh=REFRESH)
    seen = Seen()
    cache.add_handler(SECRET, seen)
    fake.add(SECRET, secret("own", OPERATOR, "b3du"))
    fake.add(SECRET, secret("state", GATEWAY, "c3RhdGU="))
    fake.add(SECRET, secret("tls", "shop", "dGxz"))
    fake.add(SECRET, secret("unrelated", "shop", "bm9pc2U="))
    task = asyncio.create_task(cache.run())
    await cache.wait_for_sync(5)
    seen.events.clear()
    yield Running(fake, client, cache, clock, seen)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_only_the_named_namespaces_are_listed_and_watched(running: Running) -> None:
    informers = {(resource.plural, namespace) for resource, namespace, _ in running.cache._informers}
    assert informers == {("secrets", OPERATOR), ("secrets", GATEWAY)}, "no informer of all namespaces"
    for namespace in (None, "shop"):
        with pytest.raises(ValueError, match="cached in"):
            running.cache.informer(SECRET, namespace)
    own = running.cache.get(SECRET, "own", OPERATOR)
    assert own is not None and own["data"] == {"key": "b3du"}, "whole in the operator's namespace"
    assert {o["metadata"]["name"] for o in running.cache.list(SECRET)} == {"own", "state"}
    assert [o["metadata"]["name"] for o in running.cache.list(SECRET, GATEWAY)] == ["state"]
    with pytest.raises(KeyError, match="not listed in shop"):
        running.cache.list(SECRET, "shop")
    assert running.client.gets == [], "nothing was fetched: nothing outside them was read"


async def test_an_object_elsewhere_is_fetched_on_its_first_read_and_then_read_from_memory(running: Running) -> None:
    cache, client = running.cache, running.client
    with pytest.raises(NotYetCached):
        cache.get(SECRET, "tls", "shop")
    body = await read(cache, lambda: cache.get(SECRET, "tls", "shop"))
    assert body is not None and body["data"] == {"key": "dGxz"}
    assert await read(cache, lambda: cache.get(SECRET, "missing", "shop")) is None, "a 404 reads as absent"
    for _ in range(3):
        cache.get(SECRET, "tls", "shop")
        cache.get(SECRET, "missing", "shop")
    assert client.gets == ["shop/tls", "shop/missing"], "one GET each until the refresh interval passed"
    assert set(cache._by_metadata[SECRET].bodies) == {"shop/tls"}, "no body of an object never read"


async def test_an_old_answer_is_still_read_and_fetched_again_and_a_change_reaches_the_handlers(
        running: Running) -> None:
    cache, client, fake = running.cache, running.client, running.fake
    await read(cache, lambda: cache.get(SECRET, "tls", "shop"))
    assert await read(cache, lambda: cache.get(SECRET, "late", "shop")) is None
    current = fake.get(SECRET, "tls", "shop")
    assert current is not None
    fake.update(SECRET, {**current, "data": {"key": "bmV3"}})
    fake.add(SECRET, secret("late", "shop", "bGF0ZQ=="))
    assert running.seen.events == [], "nothing is watched in shop: nothing is told before a read"

    running.clock.advance(REFRESH)
    old = cache.get(SECRET, "tls", "shop")
    assert old is not None and old["data"] == {"key": "dGxz"}, "the last answer, while the new one is fetched"
    assert cache.get(SECRET, "late", "shop") is None
    await until(lambda: len(running.seen.events) == 2, "the handlers told of both changes")
    assert sorted(running.seen.events) == [("add", "late"), ("update", "tls")]
    new = cache.get(SECRET, "tls", "shop")
    assert new is not None and new["data"] == {"key": "bmV3"}
    assert client.gets.count("shop/tls") == 2

    await fake.delete(SECRET, "late", "shop")
    running.clock.advance(REFRESH)
    cache.get(SECRET, "late", "shop")
    await until(lambda: ("delete", "late") in running.seen.events, "the deletion told")
    assert cache.get(SECRET, "late", "shop") is None


async def test_a_write_is_read_back_and_told_to_the_handlers(running: Running) -> None:
    cache = running.cache
    await read(cache, lambda: cache.get(SECRET, "tls", "shop"))
    written = {**secret("tls", "shop", "d3JpdHRlbg=="), "metadata": {
        "name": "tls", "namespace": "shop", "resourceVersion": "999", "labels": {}}}
    cache.observe(SECRET, written)
    body = cache.get(SECRET, "tls", "shop")
    assert body is not None and body["data"] == {"key": "d3JpdHRlbg=="}
    assert running.seen.events == [("update", "tls")]
    assert running.client.gets == ["shop/tls"]


async def test_a_refused_read_is_absent_and_asked_again_only_after_the_refresh(running: Running) -> None:
    cache, client = running.cache, running.client
    running.fake.add(SECRET, secret("key", "closed", "c2VjcmV0"))
    assert await read(cache, lambda: cache.get(SECRET, "key", "closed")) is None
    assert cache.get(SECRET, "key", "closed") is None
    assert client.gets == ["closed/key"], "a 403 is an answer, not a failure retried every second"
    client.forbidden.clear()  # the namespace lets the operator in
    running.clock.advance(REFRESH)
    cache.get(SECRET, "key", "closed")
    await until(lambda: cache.get(SECRET, "key", "closed") is not None, "the Secret once readable")
    assert running.seen.events == [("add", "key")]


async def test_answers_nobody_reads_are_forgotten(running: Running) -> None:
    cache = running.cache
    await read(cache, lambda: cache.get(SECRET, "tls", "shop"))
    running.clock.advance(FETCH_FORGET + 1)
    await read(cache, lambda: cache.get(SECRET, "unrelated", "shop"))
    assert set(cache._by_metadata[SECRET].bodies) == {"shop/unrelated"}
    with pytest.raises(NotYetCached):
        cache.get(SECRET, "tls", "shop")


async def test_handlers_of_all_namespaces_hear_the_named_namespaces_informers_too(running: Running) -> None:
    running.fake.add(SECRET, secret("new", GATEWAY, "bmV3"))
    await until(lambda: running.seen.events == [("add", "new")], "the gateway namespace's informer")


async def test_a_controller_retries_the_request_whose_read_waited_for_the_fetch(running: Running) -> None:
    cache = running.cache
    seen: list[str] = []

    class Reads:
        async def reconcile(self, request: Request) -> Result:
            obj = cache.get(SECRET, request.name, request.namespace)
            seen.append((obj or {}).get("data", {}).get("key", "none"))
            return Result()

    controller = Controller("reads", Reads(), cache)
    task = asyncio.create_task(controller.run())
    controller.queue.add(Request("shop", "tls"))
    await until(lambda: seen == ["dGxz"], "one reconcile, after the fetch")
    controller.shutdown()
    await asyncio.wait_for(task, 5)
    assert controller.queue.num_requeues(Request("shop", "tls")) == 0


def test_cache_in_must_come_before_the_kinds_informers() -> None:
    cache = SharedCache(FakeClient().lister_watcher)
    cache.informer(CONFIG_MAP)
    with pytest.raises(ValueError, match="before its informers"):
        cache.cache_in(CONFIG_MAP, (OPERATOR,))
