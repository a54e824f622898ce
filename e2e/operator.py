"""Helpers for tests that run the operator's reconcilers in-process against the real components."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from e2e.polling import eventually
from hack.localenv import Headscale
from tailnet_operator.controllers.egress_status import AgentStatusReader
from tailnet_operator.controllers.gateway import GatewaySettings
from tailnet_operator.controllers.kinds import TAILNET
from tailnet_operator.controllers.policy import PolicyReconciler
from tailnet_operator.controllers.setup import setup
from tailnet_operator.controllers.tailnet import TailnetReconciler
from tailnet_operator.names import OPERATOR
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.clock import RealClock
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.events import EventRecorder
from tailnet_operator.runtime.kinds import SECRET
from tailnet_operator.runtime.manager import Manager, ManagerOptions


class ShiftedClock:
    """The real clock, with a wall-clock offset a test can move forward (waits are not shifted)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)
        self._real = RealClock()

    def now(self) -> float:
        return self._real.now()

    async def sleep(self, seconds: float) -> None:
        await self._real.sleep(seconds)

    def utcnow(self) -> datetime:
        return datetime.now(UTC) + self.offset


@dataclass
class RunningOperator:
    manager: Manager
    tailnet: TailnetReconciler
    policy: PolicyReconciler
    namespace: str

    def poke(self, name: str) -> None:
        """Reconcile a Tailnet now (its controllers' queues), as a timer or a watch would."""
        from tailnet_operator.runtime.controller import Request

        for controller in self.manager.controllers:
            controller.queue.add(Request("", name))


@asynccontextmanager
async def running_operator(kubeconfig: Path, namespace: str, *, clock: ShiftedClock | None = None,
                           after_store: Callable[[], Awaitable[None]] | None = None,
                           gateway: GatewaySettings | None = None,
                           agent_status: AgentStatusReader | None = None) -> AsyncIterator[RunningOperator]:
    """The operator's controllers in this process; ``agent_status`` stands in for the agents'
    ``/status`` (default: read over the cluster network, which a test without a node cannot reach)."""
    manager = Manager(rest_config.load(kubeconfig), ManagerOptions(field_manager=OPERATOR, graceful_shutdown_timeout=5),
                      registry=CollectorRegistry())
    events = EventRecorder(manager.client, reporting_controller=OPERATOR, reporting_instance="test")
    tailnet, policy, *_ = setup(manager, namespace=namespace, events=events, clock=clock, gateway=gateway,
                                agent_status=agent_status)
    tailnet.after_store = after_store
    task = asyncio.create_task(manager.run())
    try:
        await eventually(lambda: manager.cache.informer(TAILNET).synced or task.done(), what="cache sync")
        if task.done():
            task.result()
        yield RunningOperator(manager, tailnet, policy, namespace)
    finally:
        manager.stop()
        await asyncio.gather(task, return_exceptions=True)


async def remove_tailnets(admin: Client, namespace: str) -> None:
    """Delete the Tailnets whose bootstrap Secret lives in ``namespace``, finalizers and all.

    Tests end with their Headscale stopped, so no operator could expire the keys any more.
    """
    for obj in (await admin.list(TAILNET)).items:
        if obj["spec"]["bootstrapKeySecretRef"]["namespace"] != namespace:
            continue
        name = obj["metadata"]["name"]
        try:
            await admin.merge_patch(TAILNET, name, {"metadata": {"finalizers": None}})
            await admin.delete(TAILNET, name)
        except NotFound:
            pass


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def create_bootstrap_secret(admin: Client, namespace: str, name: str, key: str) -> None:
    await admin.apply(SECRET, {"metadata": {"name": name, "namespace": namespace}, "type": "Opaque",
                               "data": {"apiKey": base64.b64encode(key.encode()).decode()}})


def tailnet_object(name: str, headscale: Headscale, namespace: str, *, secret: str = "bootstrap",
                   ca: bool = True, lifetime: str = "2h", **spec: Any) -> JSON:
    body: dict[str, Any] = {
        "loginURL": headscale.url,
        "bootstrapKeySecretRef": {"namespace": namespace, "name": secret, "key": "apiKey"},
        "apiKeyLifetime": lifetime,
        **spec,
    }
    if ca:
        body["caBundle"] = headscale.ca_bundle.read_text()
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "Tailnet", "metadata": {"name": name}, "spec": body}


async def get_or_none(admin: Client, resource: Any, name: str, namespace: str | None = None) -> JSON | None:
    """The object, or None when it does not exist."""
    try:
        return await admin.get(resource, name, namespace)
    except NotFound:
        return None


async def gone(admin: Client, resource: Any, name: str, namespace: str | None = None) -> bool:
    return await get_or_none(admin, resource, name, namespace) is None


async def condition(admin: Client, resource: Any, name: str, type_: str, namespace: str | None = None) -> JSON:
    if (obj := await get_or_none(admin, resource, name, namespace)) is None:
        return {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def has_condition(admin: Client, resource: Any, name: str, type_: str, status: str, reason: str | None = None,
                  namespace: str | None = None) -> Callable[[], Awaitable[JSON | None]]:
    async def check() -> JSON | None:
        cond = await condition(admin, resource, name, type_, namespace)
        if cond.get("status") == status and (reason is None or cond.get("reason") == reason):
            return cond
        return None

    return check
