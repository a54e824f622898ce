"""A test kind ("Widget") and a reconciler for it, used to exercise the runtime end to end.

Each Widget owns one ConfigMap holding its ``spec.value``; its status echoes the generation
it has seen. The reconciler follows the operator's rules: read the cache, build the desired
objects with a pure function, write only what differs, through server-side apply.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from tailnet_operator.runtime.cache import SharedCache
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.controller import Request, Result
from tailnet_operator.runtime.kinds import CONFIG_MAP, Resource

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
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {
            "name": f"{meta['name']}-data", "namespace": meta["namespace"],
            "ownerReferences": [{"apiVersion": f"{GROUP}/v1", "kind": "Widget", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}],
        },
        "data": {"value": obj.get("spec", {}).get("value", "")},
    }


def desired_status(obj: JSON) -> dict[str, Any]:
    return {"observedGeneration": obj["metadata"]["generation"], "value": obj.get("spec", {}).get("value", "")}


class WidgetReconciler:
    """Counts what it does so tests can check the runtime's guarantees."""

    def __init__(self, client: Client, cache: SharedCache) -> None:
        self.client = client
        self.cache = cache
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
            obj = self.cache.get(WIDGET, request.name, request.namespace)
            if obj is None:
                self.missing.add(request)
                return Result()
            self.missing.discard(request)
            want = desired_config_map(obj)
            have = self.cache.get(CONFIG_MAP, want["metadata"]["name"], request.namespace)
            if have is None or have.get("data") != want["data"]:
                await self.client.apply(CONFIG_MAP, want)
            status = desired_status(obj)
            if obj.get("status") != status:
                await self.client.apply_status(WIDGET, {
                    "metadata": {"name": request.name, "namespace": request.namespace}, "status": status})
            return Result()
        finally:
            self.in_flight -= 1
