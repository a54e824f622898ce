"""The fake client's contract: the same scenarios on ``runtime.testing.FakeClient`` and on a real
kube-apiserver (through the project's :class:`Client`) must end the same way.

Each scenario is a list of steps (create, update, apply, delete, get, watch). A step's outcome is
reduced to what a reconciler can observe and that the fake claims to model: the error (type and
HTTP status), whether the object's resourceVersion moved, its generation, finalizers, whether
deletion started, its managedFields entries (manager, operation, subresource) and its content,
or the first event of a watch. The two lists of outcomes must be equal; a failure prints both.

The watch-expiry scenario uses core Events, which kube-apiserver serves from etcd (their watch
cache is off by default), and "expires" history by compacting etcd (the fake: ``compact()``).
Other tests' informers may then see one 410 and relist, as they would after the API server's own
compaction every five minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from hack.localenv import ControlPlane
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import Client, WatchEvent
from tailnet_operator.runtime.errors import APIError, NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, NAMESPACE, Resource
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

from .widgets import WIDGET, install_widget_crd

pytestmark = pytest.mark.integration

USER = "contract-user"
"""The manager of creates and updates: kube-apiserver names it after the client's User-Agent."""
CORE_EVENT = Resource("", "v1", "events", "Event")
"""Served from etcd, not the watch cache, so a compaction makes an older resourceVersion Gone."""
WATCH_TIMEOUT = 10.0
"""Seconds to wait for a watch's first event or error."""


class Backend(Protocol):
    """The operations a scenario runs, on the fake or on the real API server."""

    namespace: str

    async def create(self, resource: Resource, body: JSON) -> JSON: ...

    async def update(self, resource: Resource, body: JSON) -> JSON: ...

    async def apply(self, resource: Resource, body: JSON, *, manager: str,
                    subresource: str | None = None) -> JSON: ...

    async def delete(self, resource: Resource, name: str, *, uid: str | None = None,
                     resource_version: str | None = None) -> JSON: ...

    async def get(self, resource: Resource, name: str) -> JSON | None: ...

    async def list_version(self, resource: Resource) -> str: ...

    def watch(self, resource: Resource, resource_version: str) -> AsyncIterator[WatchEvent]: ...

    async def expire_history(self) -> None: ...


@dataclass
class Real:
    client: Client
    plane: ControlPlane
    namespace: str

    async def create(self, resource: Resource, body: JSON) -> JSON:
        return await self.client.create(resource, body, self.namespace)

    async def update(self, resource: Resource, body: JSON) -> JSON:
        return await self.client.replace(resource, body)

    async def apply(self, resource: Resource, body: JSON, *, manager: str, subresource: str | None = None) -> JSON:
        return await self.client.apply(resource, body, subresource=subresource, field_manager=manager)

    async def delete(self, resource: Resource, name: str, *, uid: str | None = None,
                     resource_version: str | None = None) -> JSON:
        return await self.client.delete(resource, name, self.namespace, uid=uid, resource_version=resource_version)

    async def get(self, resource: Resource, name: str) -> JSON | None:
        try:
            return await self.client.get(resource, name, self.namespace)
        except NotFound:
            return None

    async def list_version(self, resource: Resource) -> str:
        return (await self.client.list(resource, self.namespace)).resource_version

    def watch(self, resource: Resource, resource_version: str) -> AsyncIterator[WatchEvent]:
        return self.client.watch(resource, self.namespace, resource_version=resource_version,
                                 timeout_seconds=WATCH_TIMEOUT * 3)

    async def expire_history(self) -> None:
        await asyncio.to_thread(self.plane.compact_etcd)


@dataclass
class Fake:
    fake: FakeClient
    namespace: str

    async def create(self, resource: Resource, body: JSON) -> JSON:
        return self.fake.add(resource, body)

    async def update(self, resource: Resource, body: JSON) -> JSON:
        return self.fake.update(resource, body)

    async def apply(self, resource: Resource, body: JSON, *, manager: str, subresource: str | None = None) -> JSON:
        return await self.fake.apply(resource, body, subresource=subresource, field_manager=manager)

    async def delete(self, resource: Resource, name: str, *, uid: str | None = None,
                     resource_version: str | None = None) -> JSON:
        return await self.fake.delete(resource, name, self.namespace, uid=uid, resource_version=resource_version)

    async def get(self, resource: Resource, name: str) -> JSON | None:
        return self.fake.get(resource, name, self.namespace)

    async def list_version(self, resource: Resource) -> str:
        return (await self.fake.lister_watcher.list(resource, self.namespace)).resource_version

    def watch(self, resource: Resource, resource_version: str) -> AsyncIterator[WatchEvent]:
        return self.fake.lister_watcher.watch(resource, self.namespace, resource_version=resource_version)

    async def expire_history(self) -> None:
        self.fake.compact()


# -- recording outcomes ---------------------------------------------------------------------------


@dataclass
class Record:
    """The outcomes of one scenario on one backend, in order."""

    backend: Backend
    outcomes: list[tuple[str, Any]] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    """The last resourceVersion seen per object name, to tell whether a step moved it."""

    async def step(self, label: str, action: Callable[[], Awaitable[JSON | None]], *,
                   observe: bool = True) -> JSON | None:
        """Run one step and keep what it showed; an error is an outcome, not a failure. With
        ``observe`` False only success counts (what a delete answers differs by kind, and the
        get that follows shows the result)."""
        try:
            result = await action()
        except Exception as exc:
            self.outcomes.append((label, _error(exc)))
            return None
        self.outcomes.append((label, self._observed(result) if observe else "ok"))
        return result

    async def watch(self, label: str, resource: Resource, resource_version: str,
                    then: Callable[[], Awaitable[object]] | None = None) -> None:
        """The first event (type, object name) of a watch from ``resource_version``, or its error;
        ``then`` runs once the watch is open, to cause the event."""
        events = self.backend.watch(resource, resource_version)

        async def first_change() -> WatchEvent:
            async for event in events:
                if event.type != "BOOKMARK":
                    return event
            raise AssertionError("the watch ended without an event")

        first = asyncio.ensure_future(first_change())
        try:
            if then is not None:
                await asyncio.sleep(0)  # let the watch request start before the write it must see
                await then()
            event = await asyncio.wait_for(first, WATCH_TIMEOUT)
            self.outcomes.append((label, ("event", event.type, event.object["metadata"]["name"])))
        except Exception as exc:
            self.outcomes.append((label, _error(exc)))
        finally:
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
            close = getattr(events, "aclose", None)  # an async generator: end its request now
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    def _observed(self, obj: JSON | None) -> Any:
        if obj is None:
            return "absent"
        if obj.get("kind") == "Status":
            return ("status", obj.get("status"))
        meta = obj["metadata"]
        name = str(meta["name"])
        moved = meta.get("resourceVersion") != self.versions.get(name)
        self.versions[name] = str(meta.get("resourceVersion"))
        return {
            "resourceVersion moved": moved,
            "generation": meta.get("generation"),
            "finalizers": sorted(meta.get("finalizers") or []),
            "deleting": bool(meta.get("deletionTimestamp")),
            "managers": sorted((e["manager"], e["operation"], e.get("subresource", ""))
                               for e in meta.get("managedFields") or []),
            "labels": meta.get("labels") or {},
            "content": {k: v for k, v in obj.items() if k in ("spec", "data", "status")},
        }


def _error(exc: Exception) -> tuple[str, str, int | None]:
    return ("error", type(exc).__name__, exc.status if isinstance(exc, APIError) else None)


def widget(name: str, namespace: str, value: str, **meta: Any) -> JSON:
    return {"apiVersion": WIDGET.api_version, "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace, **meta}, "spec": {"value": value}}


def status(name: str, namespace: str, value: str) -> JSON:
    return {"apiVersion": WIDGET.api_version, "kind": "Widget", "metadata": {"name": name, "namespace": namespace},
            "status": {"value": value}}


# -- scenarios ------------------------------------------------------------------------------------


async def stale_resource_versions(r: Record) -> None:
    """Update, apply and delete that name an old resourceVersion conflict; current ones pass."""
    b, ns = r.backend, r.backend.namespace
    first = await r.step("create", lambda: b.create(WIDGET, widget("w", ns, "a")))
    assert first is not None
    old = first["metadata"]["resourceVersion"]
    await r.step("create again", lambda: b.create(WIDGET, widget("w", ns, "a")))
    current = await r.step("update with the current version",
                           lambda: b.update(WIDGET, {**first, "spec": {"value": "b"}}))
    assert current is not None
    await r.step("update with a stale version", lambda: b.update(WIDGET, {**first, "spec": {"value": "c"}}))
    await r.step("apply with a stale version", lambda: b.apply(WIDGET, widget("w", ns, "c", resourceVersion=old),
                                                               manager="ctrl"))
    await r.step("delete with a stale version", lambda: b.delete(WIDGET, "w", resource_version=old), observe=False)
    await r.step("apply with the current version", lambda: b.apply(
        WIDGET, widget("w", ns, "c", resourceVersion=current["metadata"]["resourceVersion"]), manager="ctrl"))
    await r.step("get", lambda: b.get(WIDGET, "w"))
    await r.step("delete with the current version", lambda: b.delete(
        WIDGET, "w", resource_version=r.versions["w"]), observe=False)
    await r.step("get after delete", lambda: b.get(WIDGET, "w"))


async def field_managers(r: Record) -> None:
    """Creates and updates record an Update entry for their manager; applies take fields over."""
    b, ns = r.backend, r.backend.namespace
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": "c", "namespace": ns, "labels": {"team": "x"}}, "data": {"mine": "1", "shared": "a"}}
    created = await r.step("create", lambda: b.create(CONFIG_MAP, cm))
    assert created is not None
    applied = await r.step("apply takes one key", lambda: b.apply(
        CONFIG_MAP, {"metadata": {"name": "c", "namespace": ns}, "data": {"shared": "b"}}, manager="ctrl"))
    assert applied is not None
    same = await r.step("a PUT that changes nothing", lambda: b.update(CONFIG_MAP, applied))
    assert same is not None
    await r.step("a PUT that takes the key back", lambda: b.update(
        CONFIG_MAP, {**same, "data": {"mine": "1", "shared": "c"}}))
    await r.step("the applier stops sending it", lambda: b.apply(
        CONFIG_MAP, {"metadata": {"name": "c", "namespace": ns, "labels": {"by": "ctrl"}}}, manager="ctrl"))
    await r.step("an unconditional PUT", lambda: b.update(
        CONFIG_MAP, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": ns},
                     "data": {"only": "this"}}))


async def widget_generation_and_status(r: Record) -> None:
    """Generation follows the spec only; status applies have their own manager entry."""
    b, ns = r.backend, r.backend.namespace
    await r.step("apply creates", lambda: b.apply(WIDGET, widget("g", ns, "a"), manager="ctrl"))
    await r.step("apply the same", lambda: b.apply(WIDGET, widget("g", ns, "a"), manager="ctrl"))
    await r.step("status apply", lambda: b.apply(WIDGET, status("g", ns, "a"), manager="ctrl", subresource="status"))
    await r.step("label apply", lambda: b.apply(WIDGET, widget("g", ns, "a", labels={"l": "1"}), manager="ctrl"))
    await r.step("spec apply", lambda: b.apply(WIDGET, widget("g", ns, "b", labels={"l": "1"}), manager="ctrl"))
    await r.step("status apply on a missing object", lambda: b.apply(
        WIDGET, status("none", ns, "a"), manager="ctrl", subresource="status"))


async def finalizers_and_deletion(r: Record) -> None:
    """Deletion waits for finalizers; none may be added once it started; the last removal deletes."""
    b, ns = r.backend, r.backend.namespace
    created = await r.step("create", lambda: b.create(WIDGET, widget("f", ns, "a")))
    assert created is not None
    uid = created["metadata"]["uid"]

    def finalizers(names: list[str], manager: str) -> Callable[[], Awaitable[JSON]]:
        body = {"apiVersion": WIDGET.api_version, "kind": "Widget",
                "metadata": {"name": "f", "namespace": ns, "uid": uid, "finalizers": names}}
        return lambda: b.apply(WIDGET, body, manager=manager)

    await r.step("add a finalizer", finalizers(["example.dev/one"], "fin-one"))
    await r.step("apply another object's uid", lambda: b.apply(
        WIDGET, widget("f", ns, "a", uid=str(uuid.uuid4())), manager="ctrl"))
    await r.step("delete with another uid", lambda: b.delete(WIDGET, "f", uid=str(uuid.uuid4())), observe=False)
    await r.step("delete", lambda: b.delete(WIDGET, "f", uid=uid), observe=False)
    deleting = await r.step("get while deleting", lambda: b.get(WIDGET, "f"))
    await r.step("delete again", lambda: b.delete(WIDGET, "f"), observe=False)
    await r.step("get after deleting again", lambda: b.get(WIDGET, "f"))
    await r.step("apply a new finalizer", finalizers(["example.dev/two"], "fin-two"))
    if deleting is not None:
        grown = {**deleting, "metadata": {**deleting["metadata"],
                                          "finalizers": ["example.dev/one", "example.dev/two"]}}
        await r.step("PUT a new finalizer", lambda: b.update(WIDGET, grown))
    await r.step("get", lambda: b.get(WIDGET, "f"))
    await r.step("remove the last finalizer", finalizers([], "fin-one"), observe=False)
    await r.step("get after", lambda: b.get(WIDGET, "f"))
    await r.step("apply with the gone object's uid", finalizers(["example.dev/one"], "fin-one"))


async def expired_watch(r: Record) -> None:
    """A watch from history that was compacted answers 410; one from now sees what follows."""
    b, ns = r.backend, r.backend.namespace

    def event(name: str) -> JSON:
        return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": ns},
                "involvedObject": {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "namespace": ns},
                "reason": "Contract", "message": "a step of the fake's contract", "type": "Normal",
                "source": {"component": "contract"}}

    first = await r.step("create", lambda: b.create(CORE_EVENT, event("e1")))
    assert first is not None
    old = str(first["metadata"]["resourceVersion"])
    await r.step("create another", lambda: b.create(CORE_EVENT, event("e2")))
    await r.watch("watch from before the second, history intact", CORE_EVENT, old)
    await r.step("create a third", lambda: b.create(CORE_EVENT, event("e3")))  # so e2 is history, not the
    await b.expire_history()  # compaction revision (a watch may start there: from the version before it)
    await r.watch("watch from before the second, history compacted", CORE_EVENT, old)
    now = await b.list_version(CORE_EVENT)
    await r.watch("watch from now", CORE_EVENT, now, then=lambda: b.create(CORE_EVENT, event("e4")))


SCENARIOS = [stale_resource_versions, field_managers, widget_generation_and_status, finalizers_and_deletion,
             expired_watch]


# -- the test -------------------------------------------------------------------------------------


@pytest.fixture
async def real(control_plane: ControlPlane) -> AsyncIterator[Real]:
    namespace = f"contract-{uuid.uuid4().hex[:8]}"
    config = rest_config.load(control_plane.kubeconfig)
    async with Client(config, field_manager=USER, user_agent=USER) as client:
        await install_widget_crd(client)
        await client.create(NAMESPACE, {"metadata": {"name": namespace}})
        try:
            yield Real(client, control_plane, namespace)
        finally:
            await client.delete(NAMESPACE, namespace)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
async def test_the_fake_ends_every_scenario_as_the_real_api_server_does(
        real: Real, scenario: Callable[[Record], Awaitable[None]]) -> None:
    on_real = Record(real)
    await scenario(on_real)
    on_fake = Record(Fake(FakeClient(field_manager=USER), real.namespace))
    await scenario(on_fake)
    differences = [f"step {i} {label!r}:\n    real: {got_real}\n    fake: {got_fake}"
                   for i, ((label, got_real), (_, got_fake)) in enumerate(zip(on_real.outcomes, on_fake.outcomes,
                                                                              strict=True))
                   if got_real != got_fake]
    assert not differences, "the fake differs from kube-apiserver:\n" + "\n".join(differences)
