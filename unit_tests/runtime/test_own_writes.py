"""A reconcile's own writes do not queue it again (``ControllerOptions.ignore_own_writes``), unless
the answer holds a change someone else made meanwhile: the cache never sees that version on its
own (its watch event is older than the answer), so the answer's event is the only news of it."""

from __future__ import annotations

import copy

import pytest

from tailnet_operator.runtime.cache import SharedCache
from tailnet_operator.runtime.cache.informer import metadata_of
from tailnet_operator.runtime.client.ownwrite import OwnWrite, only_written, record
from tailnet_operator.runtime.clock import FakeClock
from tailnet_operator.runtime.controller import Controller, ControllerOptions, Request, Result
from tailnet_operator.runtime.kinds import CONFIG_MAP, Resource
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

WIDGET = Resource("test.tailnet.dev", "v1", "widgets", "Widget")
NS = "ns"


def widget(version: int, *, generation: int = 1, status: JSON | None = None, **labels: str) -> JSON:
    return {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget",
            "metadata": {"name": "w", "namespace": NS, "uid": "u1", "resourceVersion": str(version),
                         "generation": generation, "labels": labels,
                         "managedFields": [{"manager": "user", "operation": "Update"}]},
            "spec": {"value": "a"}, **({"status": status} if status else {})}


def status_body(observed: int = 1) -> JSON:
    return {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": NS},
            "status": {"observedGeneration": observed, "value": "a"}}


def answered(old: JSON, version: int, **changes: JSON) -> JSON:
    """``old`` as the apiserver would answer a write: a new resourceVersion and managedFields."""
    new = copy.deepcopy(old)
    new["metadata"]["resourceVersion"] = str(version)
    new["metadata"]["managedFields"] = [*old["metadata"]["managedFields"], {"manager": "ctl", "operation": "Apply"}]
    new.update(changes)
    return new


OWNER_REF = {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "name": "w", "uid": "u1", "controller": True,
             "blockOwnerDeletion": True}


def config_map_body(value: str = "a") -> JSON:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "w-data", "namespace": NS, "ownerReferences": [OWNER_REF]}, "data": {"value": value}}


def config_map_created(version: int, body: JSON) -> JSON:
    created = copy.deepcopy(body)
    created["metadata"] |= {"uid": "c1", "resourceVersion": str(version), "creationTimestamp": "2026-12-07T00:00:00Z",
                            "managedFields": [{"manager": "ctl", "operation": "Apply"}]}
    return created


# -- which changes a write explains ----------------------------------------------------------------


def test_a_status_write_explains_its_own_answer() -> None:
    old = widget(10)
    new = answered(old, 11, status=status_body()["status"])
    assert only_written(OwnWrite(WIDGET, status_body(), new), old, new)


@pytest.mark.parametrize("foreign", ["spec", "generation", "label", "other status field"])
def test_a_change_someone_else_made_meanwhile_is_not_the_writes(foreign: str) -> None:
    old = widget(10)
    new = answered(old, 12, status=status_body()["status"])
    if foreign == "spec":
        new["spec"] = {"value": "b"}
        new["metadata"]["generation"] = 2
    elif foreign == "generation":
        new["metadata"]["generation"] = 2
    elif foreign == "label":
        new["metadata"]["labels"] = {"team": "x"}
    else:
        new["status"] = {**new["status"], "phase": "Other"}
    assert not only_written(OwnWrite(WIDGET, status_body(), new), old, new)


def test_a_creation_explains_the_fields_it_sent_and_what_the_apiserver_sets() -> None:
    body = config_map_body()
    new = config_map_created(5, body)
    assert only_written(OwnWrite(CONFIG_MAP, body, new), None, new)
    merged = copy.deepcopy(new)
    merged["data"]["other"] = "someone else's"  # created by another writer just before the apply
    assert not only_written(OwnWrite(CONFIG_MAP, body, merged), None, merged)


def test_only_the_answer_or_its_equal_counts_not_a_reduced_copy() -> None:
    """A metadata-only informer keeps the object without its body: it cannot tell what else changed."""
    body = config_map_body()
    new = config_map_created(5, body)
    assert only_written(OwnWrite(CONFIG_MAP, body, new), None, copy.deepcopy(new)), "the watch event's copy"
    assert not only_written(OwnWrite(CONFIG_MAP, body, new), None, metadata_of(new))


def test_keyed_and_set_lists_the_write_owns_only_its_items() -> None:
    def obj(conditions: list[JSON], finalizers: list[str]) -> JSON:
        base = widget(1, status={"conditions": conditions})
        base["metadata"]["finalizers"] = finalizers
        return base

    ready = {"type": "Ready", "status": "True"}
    theirs = {"type": "Synced", "status": "True"}
    body: JSON = {"metadata": {"name": "w", "namespace": NS, "finalizers": ["mine"]},
                  "status": {"conditions": [ready]}}
    old = obj([{"type": "Ready", "status": "False"}, theirs], ["other"])
    new = answered(obj([ready, theirs], ["other", "mine"]), 2)
    assert only_written(OwnWrite(WIDGET, body, new), old, new)
    changed = answered(obj([ready, {**theirs, "status": "False"}], ["other", "mine"]), 2)
    assert not only_written(OwnWrite(WIDGET, body, changed), old, changed)
    dropped = answered(obj([ready, theirs], ["mine"]), 2)
    assert not only_written(OwnWrite(WIDGET, body, dropped), old, dropped)


# -- the controller ----------------------------------------------------------------------------------


class Writes:
    """A reconciler that makes the given writes the way the REST client reports them (each
    recorded, then its answer observed by the cache), the watch events of ``watched`` reaching
    the cache first (a copy of each answer, as the watch would bring it)."""

    def __init__(self, cache: SharedCache) -> None:
        self.cache = cache
        self.writes: list[tuple[Resource, JSON, JSON]] = []
        self.watched: set[int] = set()
        self.meanwhile: list[tuple[Resource, JSON]] = []
        self.calls = 0

    async def reconcile(self, request: Request) -> Result:
        self.calls += 1
        for index, (resource, sent, stored) in enumerate(self.writes):
            if index in self.watched:
                self.cache.informer(resource, NS)._upsert(copy.deepcopy(stored))
            record(OwnWrite(resource, sent, stored))
            self.cache.observe(resource, stored)
        for resource, obj in self.meanwhile:  # another writer's change, through the watch
            self.cache.informer(resource, NS)._upsert(obj)
        return Result()


def controller(ignore_own_writes: bool = True) -> tuple[Controller, SharedCache, Writes]:
    fake = FakeClient()
    cache = SharedCache(fake.lister_watcher, clock=FakeClock())
    reconciler = Writes(cache)
    ctrl = Controller("widget", reconciler, cache, options=ControllerOptions(ignore_own_writes=ignore_own_writes),
                      clock=FakeClock())
    ctrl.for_(WIDGET, namespace=NS).owns(CONFIG_MAP, namespace=NS)
    cache.informer(WIDGET)  # an informer of all namespaces too: the cache's siblings of the scoped one
    for informer in cache._informers.values():
        informer._synced.set()
    cache.informer(WIDGET, NS)._upsert(widget(10))
    return ctrl, cache, reconciler


async def reconcile_once(ctrl: Controller, request: Request) -> None:
    """What a worker does with ``request``: take it, reconcile it, hand it back (the queue then
    holds it again when something queued it meanwhile)."""
    ctrl.queue.add(request)
    while True:
        key = await ctrl.queue.get()
        if key == request:
            break
        ctrl.queue.done(key)
    try:
        await ctrl._reconcile(request)
    finally:
        ctrl.queue.done(request)


def own_writes(cache: SharedCache) -> list[tuple[Resource, JSON, JSON]]:
    old = cache.get(WIDGET, "w", NS)
    assert old is not None
    return [(CONFIG_MAP, config_map_body(), config_map_created(12, config_map_body())),
            (WIDGET, status_body(), answered(old, 13, status=status_body()["status"]))]


@pytest.mark.parametrize("watch_first", [False, True], ids=["answer first", "watch event first"])
async def test_the_writes_of_a_reconcile_do_not_queue_it_again_and_every_informer_takes_them(
        watch_first: bool) -> None:
    ctrl, cache, reconciler = controller()
    reconciler.writes = own_writes(cache)
    reconciler.watched = {0, 1} if watch_first else set()
    await reconcile_once(ctrl, Request(NS, "w"))
    assert ctrl.queue.len() == 0
    assert ctrl.own_writes_dropped == 1
    status = reconciler.writes[1][2]
    for informer in (cache.informer(WIDGET), cache.informer(WIDGET, NS)):
        assert informer.store.get(f"{NS}/w") == status, "the change still reaches every informer of the kind"
    assert cache.get(CONFIG_MAP, "w-data", NS) == reconciler.writes[0][2]


async def test_a_change_someone_else_made_before_the_write_still_queues_it() -> None:
    ctrl, cache, reconciler = controller()
    reconciler.writes = own_writes(cache)
    status = reconciler.writes[1][2]
    status["spec"] = {"value": "b"}
    status["metadata"]["generation"] = 2
    await reconcile_once(ctrl, Request(NS, "w"))
    assert ctrl.queue.len() == 1


async def test_a_change_someone_else_made_during_the_reconcile_still_queues_it() -> None:
    ctrl, cache, reconciler = controller()
    reconciler.writes = own_writes(cache)
    labelled = copy.deepcopy(reconciler.writes[1][2])
    labelled["metadata"] |= {"resourceVersion": "14", "labels": {"team": "a"}}
    reconciler.meanwhile = [(WIDGET, labelled)]
    await reconcile_once(ctrl, Request(NS, "w"))
    assert ctrl.queue.len() == 1


async def test_the_writes_of_another_request_and_outside_a_reconcile_still_queue() -> None:
    ctrl, cache, reconciler = controller()
    reconciler.writes = own_writes(cache)
    await reconcile_once(ctrl, Request(NS, "other"))  # the writes are of another request's objects
    assert (await ctrl.queue.get()) == Request(NS, "w")
    ctrl.queue.done(Request(NS, "w"))
    latest = cache.get(WIDGET, "w", NS)
    assert latest is not None
    record(OwnWrite(WIDGET, status_body(2), answered(latest, 15)))  # recorded by no reconcile
    cache.observe(WIDGET, answered(latest, 15))
    assert ctrl.queue.len() == 1


async def test_off_by_default() -> None:
    assert ControllerOptions().ignore_own_writes is False
    ctrl, cache, reconciler = controller(ignore_own_writes=False)
    reconciler.writes = own_writes(cache)
    await reconcile_once(ctrl, Request(NS, "w"))
    assert ctrl.queue.len() == 1
