"""The Tailnet and Policy reconcilers wired to fakes: kube (FakeClient), Headscale, Events, time."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from tailnet_operator.controllers import policy as policy_controller
from tailnet_operator.controllers import tailnet as tailnet_controller
from tailnet_operator.controllers.access import Deps, HeadscaleAccess, working_key_secret_name
from tailnet_operator.controllers.gatewayapi_plans import PARENT_INDEX, parent_index
from tailnet_operator.controllers.kinds import (
    INGRESS,
    MODELS,
    ROUTE_RESOURCES,
    TAILNET,
)
from tailnet_operator.controllers.policy import (
    CLASS_INDEX,
    INDEXED,
    TAILNET_INDEX,
    PolicyReconciler,
    class_index,
    tailnet_ref_index,
)
from tailnet_operator.controllers.tailnet import TailnetReconciler
from tailnet_operator.runtime import (
    SECRET,
    Applier,
    EventRecorder,
    FakeClock,
    Request,
    Resource,
    Result,
    Scheme,
)
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

from .fake_headscale import FakeHeadscale

NAMESPACE = "tailnet-system"
URL = "https://headscale.test:443"


@dataclass
class EventLog:
    """An EventWriter that keeps the Events' reasons and notes."""

    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON:
        self.reasons.append(str(body["reason"]))
        self.notes.append(str(body.get("note") or ""))
        return body

    async def merge_patch(self, resource: Resource, name: str, patch: JSON, namespace: str | None = None,
                          *, subresource: str | None = None) -> JSON:
        return patch


class World:
    """Both reconcilers on fakes; ``kube.writes`` and ``headscale.calls`` record what they did."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.kube = FakeClient(scheme=Scheme(MODELS), clock=self.clock)
        for resource in INDEXED:
            self.kube.add_indexer(resource, TAILNET_INDEX, tailnet_ref_index)
        self.kube.add_indexer(INGRESS, CLASS_INDEX, class_index)
        for route in ROUTE_RESOURCES:
            self.kube.add_indexer(route, PARENT_INDEX, parent_index)
        self.headscale = FakeHeadscale(self.clock)
        self.events = EventLog()
        recorder = EventRecorder(self.events, reporting_instance="test", clock=self.clock)
        self.deps = deps = Deps(reader=self.kube, access=HeadscaleAccess(self.kube, NAMESPACE, self.headscale.factory),
                                events=recorder, clock=self.clock)
        self.tailnet = TailnetReconciler(
            deps, Applier(self.kube, self.kube, field_manager=tailnet_controller.FIELD_MANAGER))
        self.policy = PolicyReconciler(
            deps, Applier(self.kube, self.kube, field_manager=policy_controller.FIELD_MANAGER))

    # -- objects ------------------------------------------------------------------------------

    def bootstrap_secret(self, key: str | None = None, *, name: str = "bootstrap") -> str:
        key = key if key is not None else self.headscale.add_key()
        data = {"apiKey": base64.b64encode(key.encode()).decode()} if key else {}
        self.kube.add(SECRET, {"metadata": {"name": name, "namespace": NAMESPACE}, "data": data})
        return key

    def add_tailnet(self, name: str = "tn", *, lifetime: str = "2h", **spec: Any) -> JSON:
        body = {"loginURL": URL, "bootstrapKeySecretRef": {"namespace": NAMESPACE, "name": "bootstrap",
                                                           "key": "apiKey"},
                "apiKeyLifetime": lifetime, **spec}
        return self.kube.add(TAILNET, {"metadata": {"name": name}, "spec": body})

    def tailnet_obj(self, name: str = "tn") -> JSON:
        obj = self.kube.get(TAILNET, name)
        assert obj is not None
        return obj

    def condition(self, type_: str, name: str = "tn", resource: Resource = TAILNET) -> JSON:
        obj = self.kube.get(resource, name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})

    def working_secret(self, name: str = "tn") -> JSON | None:
        return self.kube.get(SECRET, working_key_secret_name(name), NAMESPACE)

    def working_key(self, name: str = "tn") -> str:
        secret = self.working_secret(name)
        assert secret is not None
        return base64.b64decode(secret["data"]["apiKey"]).decode()

    # -- reconciling --------------------------------------------------------------------------

    async def reconcile_tailnet(self, name: str = "tn") -> Result:
        return await self.tailnet.reconcile(Request("", name))

    async def reconcile_policy(self, name: str = "tn") -> Result:
        return await self.policy.reconcile(Request("", name))
