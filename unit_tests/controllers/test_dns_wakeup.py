"""The DNS controller as setup() wires it, on the shared cache over the fake API server: an ingress
record's new node address reaches the hosts file even when the watch that wakes the controller (the
operator namespace's Secrets with the managed-by label) delivers it before the watch of every
Secret there, which the controller reads the record from.

Two watches of one kind are two streams from kube-apiserver, and nothing orders them (nor orders
them with the write's answer): when the labelled one came first, the reconcile it woke read the
record without its address, and nothing woke the controller again. On kind the split-DNS test's
ingress name stayed out of the hosts file for 180 s that way (docs/kind.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.controllers.dns import parse_hosts
from tailnet_operator.controllers.ingress import NODE_FIELD_MANAGER
from tailnet_operator.controllers.kinds import MODELS, TAILNET, TAILNET_INGRESS
from tailnet_operator.controllers.setup import setup
from tailnet_operator.names import MANAGED_BY
from tailnet_operator.resources import ingress as ingress_build
from tailnet_operator.runtime import (
    CONFIG_MAP,
    SECRET,
    EventRecorder,
    Manager,
    Request,
    Resource,
    Result,
    Scheme,
    SharedCache,
)
from tailnet_operator.runtime.cache.informer import label_selector
from tailnet_operator.runtime.client import WATCH_INACTIVITY_TIMEOUT, ObjectList, WatchEvent
from tailnet_operator.runtime.client.config import RestConfig
from tailnet_operator.runtime.controller import Controller, Reconciler
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

NAMESPACE = "tailnet-system"
ZONE = "corp.internal"
TENANT = "tenant"
NAME = f"shop.{ZONE}"


async def until(check: Callable[[], bool], what: str, timeout: float = 5) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not check():  # noqa: ASYNC110 (polls with a deadline)
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout} s") from None


class HeldBack:
    """The fake's lister-watcher (and its writer, whose answers reach the cache as the REST
    client's do), with the watch of every Secret in the operator namespace held back while
    ``flowing`` is clear: that stream lags the labelled one."""

    def __init__(self, fake: FakeClient) -> None:
        self.fake = fake
        self.inner = fake.lister_watcher
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.cache: SharedCache | None = None

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON:
        return await self.inner.get(resource, name, namespace)

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str | None = None) -> ObjectList:
        return await self.inner.list(resource, namespace, label_selector=label_selector)

    async def watch(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
                    label_selector: str | None = None,
                    inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]:
        lagging = resource == SECRET and namespace == NAMESPACE and label_selector is None
        async for event in self.inner.watch(resource, namespace, resource_version=resource_version,
                                            label_selector=label_selector, inactivity_timeout=inactivity_timeout):
            if lagging:
                await self.flowing.wait()
            yield event

    async def apply(self, resource: Resource, body: JSON, *, subresource: str | None = None,
                    force: bool = True, field_manager: str | None = None) -> JSON:
        stored = await self.fake.apply(resource, body, subresource=subresource, field_manager=field_manager)
        if self.cache is not None:
            self.cache.observe(resource, stored)
        return stored

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, **kwargs: Any) -> JSON:
        return await self.fake.delete(resource, name, namespace, **kwargs)


class NoEvents:
    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON:
        return body

    async def merge_patch(self, resource: Resource, name: str, patch: JSON, namespace: str | None = None,
                          *, subresource: str | None = None) -> JSON:
        return patch


class Counted:
    """The DNS reconciler, counting the reconciles that have started and finished."""

    def __init__(self, inner: Reconciler) -> None:
        self.inner = inner
        self.started = self.finished = 0

    async def reconcile(self, request: Request) -> Result:
        self.started += 1
        try:
            return await self.inner.reconcile(request)
        finally:
            self.finished += 1


@dataclass
class Running:
    fake: FakeClient
    client: HeldBack
    cache: SharedCache
    controller: Controller
    dns: Counted
    record: str

    def idle(self) -> bool:
        """Nothing queued for the DNS controller and no reconcile running."""
        return self.controller.queue.len() == 0 and self.dns.started == self.dns.finished

    def hosts(self) -> dict[str, str]:
        cm = self.fake.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
        return parse_hosts(((cm or {}).get("data") or {}).get("hosts", ""))

    def address(self, labels: Mapping[str, str] | None) -> str:
        """The node address on the record as the informer of the operator namespace's Secrets with
        ``labels`` holds it (MANAGED_BY: the DNS controller's watch; None: what it reads)."""
        informer = self.cache._informers[(SECRET, NAMESPACE, label_selector(labels))]
        record = informer.store.get(f"{NAMESPACE}/{self.record}") or {}
        return str((record.get("metadata", {}).get("annotations") or {}).get(ingress_build.NODE_ADDRESS_ANNOTATION, ""))


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    fake = FakeClient(scheme=Scheme(MODELS))
    client = HeldBack(fake)
    manager = Manager(RestConfig(host="https://127.0.0.1:1"))
    manager.cache = SharedCache(client, scheme=manager.cache.scheme)
    manager.client = client  # type: ignore[assignment]  # writes go to the fake, their answers to the cache
    client.cache = manager.cache
    setup(manager, namespace=NAMESPACE, events=EventRecorder(NoEvents(), reporting_instance="test"))
    controller: Controller = next(c for c in manager.controllers if c.name == "dns")
    dns = Counted(controller.reconciler)
    controller.reconciler = dns

    fake.add(TAILNET, {"metadata": {"name": "tn"}, "spec": {
        "loginURL": "https://headscale.test",
        "bootstrapKeySecretRef": {"namespace": NAMESPACE, "name": "bootstrap", "key": "apiKey"},
        "dns": {"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"}, "zones": [ZONE]},
        "tenants": [{"namespaces": [TENANT], "tags": ["tag:ingress-shop"], "dnsNames": [f"*.{ZONE}"]}]}})
    ingress = fake.add(TAILNET_INGRESS, {"metadata": {"name": "shop", "namespace": TENANT}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:ingress-shop", "hostname": "shop",
        "dnsTemplate": "{hostname}." + ZONE,
        "exposes": [{"name": "raw", "port": 8080, "backend": {"service": "web", "port": 8080}}]}})
    metadata = ingress_build.record_metadata(TailnetIngress.model_validate(ingress), NAMESPACE)
    fake.add(SECRET, {"metadata": metadata, "data": {"authKey": "a2V5"}})  # the key's record, no node yet

    tasks = [asyncio.create_task(manager.cache.run())]
    await manager.cache.wait_for_sync(5)
    tasks.append(asyncio.create_task(controller.run()))
    world = Running(fake, client, manager.cache, controller, dns, str(metadata["name"]))
    await until(lambda: fake.get(CONFIG_MAP, "tailnet-hosts", "kube-system") is not None and world.idle(),
                "the first hosts file, and the DNS controller idle")
    yield world
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_node_address_the_labelled_watch_brings_first_reaches_the_hosts_file(running: Running) -> None:
    assert NAME not in running.hosts()
    started = running.dns.started
    running.client.flowing.clear()

    # the Ingress reconciler notes the node's address on the record (its answer comes after both
    # watch events here: the labelled watch is first, the other one lags)
    await running.fake.apply(SECRET, {"metadata": {"name": running.record, "namespace": NAMESPACE, "annotations": {
        ingress_build.NODE_ADDRESS_ANNOTATION: "100.64.0.5,fd7a:115c:a1e0::5"}}}, field_manager=NODE_FIELD_MANAGER)
    await until(lambda: running.address(MANAGED_BY) != "", "the labelled watch to bring the address")
    await until(lambda: running.dns.started > started and running.idle(), "the reconcile that change woke")
    running.client.flowing.set()
    await until(lambda: running.address(None) != "", "the other watch to catch up")

    await until(lambda: running.hosts().get(NAME) == "100.64.0.5", f"{NAME} in the hosts file")
