"""Informers of one kind in the shared cache are separate watches that kube-apiserver answers in
no order between them: what one of them takes in goes at once into every other one whose scope
holds it, so a controller woken by a scoped watch reads at least that version from the informer
reads are served by (the DNS controller woken by the labelled Secrets of the operator namespace
read the record from the unlabelled informer, which had not caught up, and was not woken again)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from tailnet_operator.runtime.cache import SharedCache
from tailnet_operator.runtime.cache.informer import DeletedFinalStateUnknown, Informer
from tailnet_operator.runtime.client import WATCH_INACTIVITY_TIMEOUT, ObjectList, WatchEvent
from tailnet_operator.runtime.kinds import SECRET, Resource
from tailnet_operator.types import JSON

OPS = "tailnet-system"
APP = {"app": "x"}


async def until(check: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(5):
            while not check():  # noqa: ASYNC110 (polls with a deadline)
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what}: not within 5 s") from None


class Streams:
    """A lister-watcher whose watches are separate streams, one per (namespace, label selector),
    each sent to by the test alone: which one delivers first is the test's to say."""

    def __init__(self) -> None:
        self.queues: dict[tuple[str | None, str | None], asyncio.Queue[WatchEvent]] = {}

    def _queue(self, namespace: str | None, selector: str | None) -> asyncio.Queue[WatchEvent]:
        return self.queues.setdefault((namespace, selector), asyncio.Queue())

    def send(self, namespace: str | None, selector: str | None, type_: str, obj: JSON) -> None:
        self._queue(namespace, selector).put_nowait(WatchEvent(type_, obj))

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str | None = None) -> ObjectList:
        return ObjectList([], "1")

    async def watch(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
                    label_selector: str | None = None,
                    inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]:
        queue = self._queue(namespace, label_selector)
        while True:
            yield await queue.get()


def secret(version: int, namespace: str = OPS, name: str = "record", **labels: str) -> JSON:
    return {"apiVersion": "v1", "kind": "Secret", "data": {"key": "a2V5"},
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(version), "labels": labels,
                         "annotations": {"version": str(version)}}}


@dataclass
class Reads:
    """A controller's handler on one informer, noting what a reconcile it wakes would read from
    another informer at that moment (the version, or None)."""

    read_from: Informer
    key: str = f"{OPS}/record"
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    def _note(self, what: str) -> None:
        obj = self.read_from.store.get(self.key)
        self.seen.append((what, None if obj is None else obj["metadata"]["resourceVersion"]))

    def on_add(self, obj: JSON) -> None:
        self._note("add")

    def on_update(self, old: JSON, new: JSON) -> None:
        self._note("update")

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        self._note("delete")


@dataclass
class Running:
    streams: Streams
    cache: SharedCache
    whole: Informer
    labelled: Informer


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    streams = Streams()
    cache = SharedCache(streams)
    whole, labelled = cache.informer(SECRET, OPS), cache.informer(SECRET, OPS, labels=APP)
    cache.informer(SECRET, "elsewhere")
    task = asyncio.create_task(cache.run())
    await cache.wait_for_sync(5)
    yield Running(streams, cache, whole, labelled)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def version(informer: Informer, key: str = f"{OPS}/record") -> str | None:
    obj = informer.store.get(key)
    return None if obj is None else str(obj["metadata"]["resourceVersion"])


async def test_a_change_the_scoped_watch_brings_first_is_read_by_the_reconcile_it_wakes(running: Running) -> None:
    reads = Reads(running.whole)
    running.labelled.add_handler(reads)

    running.streams.send(OPS, "app=x", "ADDED", secret(5, **APP))
    await until(lambda: len(reads.seen) == 1, "the labelled watch's event")
    running.streams.send(OPS, "app=x", "MODIFIED", secret(7, **APP))
    await until(lambda: len(reads.seen) == 2, "the labelled watch's second event")

    assert reads.seen == [("add", "5"), ("update", "7")], "the unlabelled informer had each version already"
    running.streams.send(OPS, None, "MODIFIED", secret(7, **APP))  # its own stream, late: nothing new
    running.streams.send(OPS, None, "MODIFIED", secret(6, **APP))  # older than what it holds: dropped
    await until(lambda: running.streams.queues[(OPS, None)].empty(), "the late events")
    assert version(running.whole) == version(running.labelled) == "7"
    assert len(reads.seen) == 2


async def test_an_object_goes_only_where_its_scope_is(running: Running) -> None:
    running.streams.send(OPS, None, "ADDED", secret(3, name="unlabelled"))
    await until(lambda: version(running.whole, f"{OPS}/unlabelled") == "3", "the unlabelled informer")

    assert version(running.labelled, f"{OPS}/unlabelled") is None, "no label: not the labelled informer's"
    assert all(version(i, f"{OPS}/unlabelled") is None for (_, ns, _), i in running.cache._informers.items()
               if ns == "elsewhere"), "another namespace's informer"


async def test_a_deletion_passes_on_from_an_unlabelled_informer_only(running: Running) -> None:
    reads = Reads(running.whole)
    running.labelled.add_handler(reads)
    running.streams.send(OPS, "app=x", "ADDED", secret(5, **APP))
    await until(lambda: version(running.whole) == "5", "the record in both")

    # the labelled watch says deleted when the object loses the label (with its previous content)
    running.streams.send(OPS, "app=x", "DELETED", secret(6, **APP))
    await until(lambda: version(running.labelled) is None, "the labelled informer's deletion")
    assert version(running.whole) == "5", "the object still exists: the unlabelled informer keeps it"

    running.streams.send(OPS, "app=x", "ADDED", secret(8, **APP))
    await until(lambda: version(running.whole) == "8", "the label back")
    running.streams.send(OPS, None, "DELETED", secret(9, **APP))  # deleted for real: the unlabelled watch first
    await until(lambda: version(running.whole) is None, "the deletion")
    assert version(running.labelled) is None, "gone from the labelled informer at once"
    assert reads.seen[-1] == ("delete", None), "its handlers told, and a read then finds nothing"


async def test_metadata_only_informers_get_metadata_and_give_whole_ones_nothing() -> None:
    streams = Streams()
    cache = SharedCache(streams)
    cache.cache_by_metadata(SECRET, namespace=OPS)  # whole in OPS, metadata only everywhere
    whole, metadata = cache.informer(SECRET, OPS), cache.informer(SECRET)
    task = asyncio.create_task(cache.run())
    try:
        await cache.wait_for_sync(5)
        streams.send(OPS, None, "ADDED", secret(4))
        await until(lambda: version(metadata) == "4", "the metadata-only informer")
        held = metadata.store.get(f"{OPS}/record")
        assert held is not None and "data" not in held and "annotations" not in held["metadata"]

        streams.send(None, None, "MODIFIED", secret(5))
        await until(lambda: version(metadata) == "5", "the metadata-only watch's event")
        assert version(whole) == "4", "a whole informer never takes metadata alone"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
