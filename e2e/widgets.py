"""A test kind ("Widget") and a reconciler for it, used to exercise the runtime end to end.

Each Widget owns one ConfigMap holding its ``spec.value``; its status echoes the generation
it has seen. The reconciler is what a new controller looks like on the runtime: it reads the
cache (a :class:`~tailnet_operator.runtime.Reader`), builds the desired objects with pure
functions, and hands them whole to a :class:`~tailnet_operator.runtime.Writer` (the manager's
Applier, which sends only what differs from the cache).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tailnet_operator.runtime import (
    CONFIG_MAP,
    JSON,
    Reader,
    Request,
    Resource,
    Result,
    Writer,
    set_controller_reference,
)
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import AlreadyExists
from tailnet_operator.runtime.kinds import CUSTOM_RESOURCE_DEFINITION

from .polling import eventually

if TYPE_CHECKING:
    from tailnet_operator.runtime import Manager

GROUP = "test.tailnet.dev"
WIDGET = Resource(GROUP, "v1", "widgets", "Widget")

WIDGET_CRD: JSON = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {"type": "object", "properties": {"value": {"type": "string"}}},
                    "status": {"type": "object", "properties": {
                        "observedGeneration": {"type": "integer"}, "value": {"type": "string"}}},
                },
            }},
        }],
    },
}


def widget(name: str, namespace: str, value: str) -> JSON:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"value": value}}


def desired_config_map(obj: JSON) -> JSON:
    """The ConfigMap a Widget owns (pure)."""
    meta = obj["metadata"]
    return set_controller_reference(obj, {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{meta['name']}-data", "namespace": meta["namespace"]},
        "data": {"value": obj.get("spec", {}).get("value", "")},
    })


def desired_status(obj: JSON) -> dict[str, Any]:
    return {"observedGeneration": obj["metadata"]["generation"], "value": obj.get("spec", {}).get("value", "")}


class WidgetReconciler:
    """Counts what it does so tests can check the runtime's guarantees."""

    def __init__(self, reader: Reader, writer: Writer) -> None:
        self.reader = reader
        self.writer = writer
        self.calls: Counter[Request] = Counter()
        self.missing: set[Request] = set()
        self.in_flight = 0
        self.hold = asyncio.Event()
        self.hold.set()

    async def reconcile(self, request: Request) -> Result:
        self.calls[request] += 1
        self.in_flight += 1
        try:
            await self.hold.wait()
            obj = self.reader.get(WIDGET, request.name, request.namespace)
            if obj is None:
                self.missing.add(request)
                return Result()
            self.missing.discard(request)
            await self.writer.apply(CONFIG_MAP, desired_config_map(obj))
            await self.writer.apply_status(WIDGET, {
                "metadata": {"name": request.name, "namespace": request.namespace}, "status": desired_status(obj)})
            return Result()
        finally:
            self.in_flight -= 1


async def quiet(manager: Manager, reconciler: WidgetReconciler, client: Client, namespace: str,
                names: Iterable[str]) -> None:
    """Wait until the manager has nothing left to do about the Widgets ``names``.

    First its cache must hold the apiserver's current version of each Widget and of its
    ConfigMap: every event of the writes so far has then reached the handlers (or was the
    manager's own write, which causes none). Then no reconcile may be queued or running. No
    fixed wait: a reconcile that writes once too often is counted before this returns.
    """
    wanted = {WIDGET: set(names)}
    wanted[CONFIG_MAP] = {f"{name}-data" for name in wanted[WIDGET]}

    async def caught_up() -> bool:
        for resource, of_interest in wanted.items():  # one list per kind, not a get per object
            current = {o["metadata"]["name"]: o["metadata"]["resourceVersion"]
                       for o in (await client.list(resource, namespace)).items}
            for name in of_interest:
                cached = manager.cache.get(resource, name, namespace)
                if cached is None or cached["metadata"]["resourceVersion"] != current.get(name):
                    return False
        return True

    def idle() -> bool:
        return all(c.queue.len() == 0 for c in manager.controllers) and reconciler.in_flight == 0

    await eventually(caught_up, what="the manager's cache to hold the latest versions")
    await eventually(idle, what="the queue to drain")


async def install_widget_crd(client: Client) -> None:
    """The Widget CRD, installed once per control plane and Established."""
    with contextlib.suppress(AlreadyExists):  # installed by an earlier test of the session
        await client.create(CUSTOM_RESOURCE_DEFINITION, WIDGET_CRD)

    async def established() -> bool:
        crd = await client.get(CUSTOM_RESOURCE_DEFINITION, WIDGET_CRD["metadata"]["name"])
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    await eventually(established, what="the Widget CRD to be Established")
