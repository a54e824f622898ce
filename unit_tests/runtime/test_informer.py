"""The informer's store logic with a scripted list/watch: indexes, tombstones, resume and relist."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tailnet_operator.runtime.cache.informer import DeletedFinalStateUnknown, Informer, Store, informer_backoff
from tailnet_operator.runtime.client import JSON, ObjectList, WatchEvent
from tailnet_operator.runtime.errors import Gone, NotFound, TransportError
from tailnet_operator.runtime.kinds import CONFIG_MAP


def cm(name: str, rv: str, ns: str = "a", **labels: str) -> JSON:
    return {"metadata": {"name": name, "namespace": ns, "resourceVersion": rv, "labels": labels}}


class ScriptedClient:
    """Answers list() from a queue of lists and watch() from a queue of event scripts."""

    def __init__(self, lists: list[ObjectList | Exception], watches: list[list[WatchEvent] | Exception]) -> None:
        self.lists = lists
        self.watches = watches
        self.watched_from: list[str] = []
        self.exhausted = asyncio.Event()

    async def list(self, resource: Any, namespace: Any = None, **_: Any) -> ObjectList:
        answer = self.lists.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def watch(self, resource: Any, namespace: Any = None, *, resource_version: str,
                    **_: Any) -> AsyncIterator[WatchEvent]:
        self.watched_from.append(resource_version)
        if not self.watches:
            self.exhausted.set()
            await asyncio.Event().wait()
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        for event in script:
            yield event


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_add(self, obj: JSON) -> None:
        self.events.append(("add", obj["metadata"]["name"]))

    def on_update(self, old: JSON, new: JSON) -> None:
        self.events.append(("update", new["metadata"]["name"]))

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        self.events.append(("tombstone" if isinstance(obj, DeletedFinalStateUnknown) else "delete",
                            obj.key if isinstance(obj, DeletedFinalStateUnknown) else obj["metadata"]["name"]))


class NoWaitClock:
    """A clock whose sleeps only yield: retries happen at once."""

    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)

    def utcnow(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC)


async def run_until_exhausted(client: ScriptedClient, *, optional: bool = False) -> tuple[Informer, Recorder]:
    informer = Informer(client, CONFIG_MAP, backoff=informer_backoff(jitter=0), clock=NoWaitClock(),
                        optional=optional)
    recorder = Recorder()
    informer.add_handler(recorder)
    task = asyncio.create_task(informer.run())
    await asyncio.wait_for(client.exhausted.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return informer, recorder


def test_store_indexes_follow_updates_and_removals() -> None:
    store = Store()
    store.add_indexer("team", lambda o: [o["metadata"]["labels"].get("team", "")])
    store.put(cm("x", "1", team="red"))
    store.put(cm("y", "1", ns="b", team="red"))
    assert [o["metadata"]["name"] for o in store.by_index("team", "red")] == ["x", "y"]
    store.put(cm("x", "2", team="blue"))
    assert [o["metadata"]["name"] for o in store.by_index("team", "red")] == ["y"]
    assert [o["metadata"]["name"] for o in store.by_index("namespace", "a")] == ["x"]
    store.remove("b/y")
    assert store.by_index("team", "red") == []
    with pytest.raises(ValueError):
        store.add_indexer("team", lambda o: [])


async def test_a_broken_watch_resumes_from_the_last_resource_version_without_listing() -> None:
    client = ScriptedClient(
        lists=[ObjectList([cm("x", "10")], "10")],
        watches=[[WatchEvent("ADDED", cm("y", "11")), WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "15"}})],
                 TransportError("connection reset"),
                 [WatchEvent("MODIFIED", cm("x", "16")), WatchEvent("DELETED", cm("y", "17"))]])
    informer, recorder = await run_until_exhausted(client)
    assert client.watched_from == ["10", "15", "15", "17"]
    assert informer.stats.lists == 1
    assert recorder.events == [("add", "x"), ("add", "y"), ("update", "x"), ("delete", "y")]
    assert informer.store.object_keys() == ["a/x"]


async def test_gone_relists_and_emits_tombstones_for_objects_that_vanished() -> None:
    client = ScriptedClient(
        lists=[ObjectList([cm("x", "10"), cm("y", "10")], "10"),
               ObjectList([cm("x", "10"), cm("z", "30")], "30")],
        watches=[Gone(410, "Expired", "too old resource version")])
    informer, recorder = await run_until_exhausted(client)
    assert client.watched_from == ["10", "30"]
    assert informer.stats.relists_after_gone == 1
    assert ("tombstone", "a/y") in recorder.events
    assert ("add", "z") in recorder.events
    assert ("update", "x") not in recorder.events, "an unchanged object is not an update"


def test_backoff_doubles_from_800ms_to_a_30s_cap() -> None:
    backoff = informer_backoff(jitter=0)
    assert [backoff.next() for _ in range(8)] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    backoff.reset()
    assert backoff.next() == 0.8


def _not_served() -> NotFound:
    return NotFound(404, "NotFound", "the server could not find the requested resource")


async def test_an_optional_kind_not_served_is_synced_empty_and_listed_again_until_it_is() -> None:
    """A CRD installed after the operator started: its objects arrive as adds, with no restart."""
    client = ScriptedClient(lists=[_not_served(), _not_served(), ObjectList([cm("x", "5")], "5")], watches=[])
    informer, recorder = await run_until_exhausted(client, optional=True)
    assert informer.synced and not informer.absent
    assert informer.stats.lists == 3 and informer.stats.watch_errors == 0
    assert recorder.events == [("add", "x")]


async def test_an_optional_kind_is_synced_while_it_is_not_served() -> None:
    never = asyncio.Event()

    class Absent(ScriptedClient):
        async def list(self, resource: Any, namespace: Any = None, **_: Any) -> ObjectList:
            if not self.lists:
                await never.wait()
            return await super().list(resource, namespace)

    informer = Informer(Absent([_not_served()], []), CONFIG_MAP, clock=NoWaitClock(), optional=True)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.wait_synced(), 5)
        assert informer.absent and len(informer.store) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_required_kind_not_served_is_retried_with_backoff_and_not_synced_before_its_list() -> None:
    client = ScriptedClient(lists=[_not_served(), ObjectList([cm("x", "5")], "5")], watches=[])
    informer, recorder = await run_until_exhausted(client)
    assert informer.stats.watch_errors == 1 and informer.stats.lists == 2
    assert recorder.events == [("add", "x")]
