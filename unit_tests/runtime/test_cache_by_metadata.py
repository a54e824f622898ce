"""A kind cached by metadata: whole objects in one namespace, elsewhere metadata only, and the
bodies of the objects a reconciler reads fetched once per resourceVersion."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from tailnet_operator.runtime.cache import NotYetCached, SharedCache
from tailnet_operator.runtime.controller import Controller, Request
from tailnet_operator.runtime.kinds import SECRET
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

OPERATOR = "tailnet-system"


def secret(name: str, namespace: str, value: str) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace, "annotations": {"big": "x" * 1000}},
            "data": {"key": value}}


async def until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10):
        while not check():  # noqa: ASYNC110 (polls with a deadline)
            await asyncio.sleep(0.01)


@pytest.fixture
async def running() -> AsyncIterator[tuple[FakeClient, SharedCache]]:
    fake = FakeClient()
    cache = SharedCache(fake.lister_watcher)
    cache.cache_by_metadata(SECRET, namespace=OPERATOR)
    fake.add(SECRET, secret("own", OPERATOR, "b3du"))
    fake.add(SECRET, secret("bootstrap", "apps", "a2V5"))
    fake.add(SECRET, secret("noise", "apps", "bm9pc2U="))
    task = asyncio.create_task(cache.run())
    await cache.wait_for_sync(5)
    yield fake, cache
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def read_when_fetched(cache: SharedCache, read: Callable[[], JSON | None]) -> JSON | None:
    try:
        return read()
    except NotYetCached as pending:
        fetched = asyncio.Event()
        cache.when_fetched(pending, fetched.set)
        async with asyncio.timeout(10):
            await fetched.wait()
        return read()


async def test_bodies_are_held_only_in_the_operator_namespace_and_for_objects_read(
        running: tuple[FakeClient, SharedCache]) -> None:
    _fake, cache = running
    metadata = cache.informer(SECRET).store
    assert {o["metadata"]["name"] for o in metadata.objects()} == {"own", "bootstrap", "noise"}
    assert all("data" not in o and "annotations" not in o["metadata"] for o in metadata.objects()), \
        "the cluster-wide informer holds metadata only"
    own = cache.get(SECRET, "own", OPERATOR)
    assert own is not None and own["data"] == {"key": "b3du"}, "the operator's namespace is cached whole"

    with pytest.raises(NotYetCached):
        cache.get(SECRET, "bootstrap", "apps")
    body = await read_when_fetched(cache, lambda: cache.get(SECRET, "bootstrap", "apps"))
    assert body is not None and body["data"] == {"key": "a2V5"}
    assert cache.get(SECRET, "missing", "apps") is None, "an object the metadata lacks does not exist"
    assert set(cache._by_metadata[SECRET].bodies) == {"apps/bootstrap"}, "no body of an object never read"


async def test_a_changed_body_is_fetched_again_and_a_deleted_one_forgotten(
        running: tuple[FakeClient, SharedCache]) -> None:
    fake, cache = running
    await read_when_fetched(cache, lambda: cache.get(SECRET, "bootstrap", "apps"))
    current = fake.get(SECRET, "bootstrap", "apps")
    assert current is not None
    fake.update(SECRET, {**current, "data": {"key": "bmV3"}})

    def fresh() -> bool:
        try:
            body = cache.get(SECRET, "bootstrap", "apps")
        except NotYetCached:
            return False
        return body is not None and body["data"] == {"key": "bmV3"}

    await until(fresh, "the new body")
    await fake.delete(SECRET, "bootstrap", "apps")
    await until(lambda: cache.get(SECRET, "bootstrap", "apps") is None, "the deletion")
    assert "apps/bootstrap" not in cache._by_metadata[SECRET].bodies


async def test_a_controller_retries_a_request_whose_read_waited_for_a_body(
        running: tuple[FakeClient, SharedCache]) -> None:
    _fake, cache = running
    seen: list[str] = []

    class Reads:
        async def reconcile(self, request: Request) -> object:
            from tailnet_operator.runtime.controller import Result

            obj = cache.get(SECRET, request.name, request.namespace)
            seen.append((obj or {}).get("data", {}).get("key", "none"))
            return Result()

    controller = Controller("reads", Reads(), cache)  # type: ignore[arg-type]
    task = asyncio.create_task(controller.run())
    controller.queue.add(Request("apps", "noise"))
    await until(lambda: seen == ["bm9pc2U="], "one reconcile, after the fetch")
    controller.shutdown()
    await asyncio.wait_for(task, 5)
    assert seen == ["bm9pc2U="]
    assert controller.queue.num_requeues(Request("apps", "noise")) == 0, \
        "the reconcile that found the body missing was retried once it came, not failed with backoff"



