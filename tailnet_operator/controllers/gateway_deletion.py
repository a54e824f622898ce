"""What deleting a TailnetGateway does, by its ``deletionPolicy``.

``Delete`` deletes the StatefulSet, the pod, the Secrets, the Services, CoreDNS, the router's
ServiceAccount and Role, and the Headscale node of the receipts with any pre-auth key not used yet
(retrying Headscale behind the finalizer, :mod:`.cleanup`); ``Retain`` (the default) leaves them
and says so in an Event. The objects carry labels, not ownerReferences, so the garbage collector
never removes the router behind the operator's back.
"""

from __future__ import annotations

import contextlib

from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.headscale import NotFound as HeadscaleNotFound
from tailnet_operator.resources import gateway as build
from tailnet_operator.runtime import (
    CONFIG_MAP,
    SECRET,
    SERVICE,
    NotFound,
    Resource,
    Result,
)
from tailnet_operator.runtime.kinds import DEPLOYMENT, POD, ROLE, ROLE_BINDING, SERVICE_ACCOUNT, STATEFUL_SET
from tailnet_operator.types import JSON

from . import finalizer
from .pipeline import Phases
from .preauth import AuthKey

__all__ = ["GatewayDeletion", "gateway_objects"]


def gateway_objects(name: str) -> list[tuple[Resource, str]]:
    """Everything the gateway ``name`` makes in the gateway namespace, in the order it is deleted
    (the router first, so it stops before what it uses goes)."""
    router, dns = build.router_name(name), build.dns_name(name)
    return [(STATEFUL_SET, router), (POD, build.pod_name(name)), (DEPLOYMENT, dns), (SERVICE, dns),
            (SERVICE, router), (CONFIG_MAP, router), (SECRET, build.state_secret_name(name)),
            (SECRET, build.auth_key_secret(name)), (ROLE_BINDING, router), (ROLE, router),
            (SERVICE_ACCOUNT, build.router_service_account_name(name))]


class GatewayDeletion:
    """Runs a deleted TailnetGateway's ``deletionPolicy`` in ``namespace`` (the gateway namespace)."""

    def __init__(self, phases: Phases[TailnetGateway], namespace: str) -> None:
        self.phases = phases
        self.namespace = namespace

    async def finalize(self, obj: JSON) -> Result:
        """Delete: the objects, the node and an unused key go; Retain: an Event says what stays."""
        if not finalizer.holds(obj):
            return Result()
        if (obj.get("spec") or {}).get("deletionPolicy", "Retain") != "Delete":
            await self._retain(obj)
        elif (again := await self._delete(obj)) is not None:
            return again
        await finalizer.release(self.phases.writer, self.phases.resource, obj)
        return Result()

    async def _retain(self, obj: JSON) -> None:
        name, node_id = obj["metadata"]["name"], _node_id(obj)
        node = f"Headscale node {node_id}" if node_id else "its Headscale node (if it registered)"
        await self.phases.events.normal(
            obj, "Retained",
            f"deletionPolicy Retain: left the router pod {self.namespace}/{build.pod_name(name)}, its state Secret "
            f"{self.namespace}/{build.state_secret_name(name)} and {node} in place; remove them by hand (kubectl "
            f"delete statefulset,secret,service,deployment,configmap,serviceaccount,role,rolebinding -n "
            f"{self.namespace} -l tailnet.dev/gateway={name}"
            + (f"; headscale nodes delete -i {node_id})" if node_id else ")"),
            action="Retain")

    async def _delete(self, obj: JSON) -> Result | None:
        """Delete what the gateway made; a Result while Headscale is still to be retried."""
        name, node_id = obj["metadata"]["name"], _node_id(obj)
        stored = self.phases.stored_key((build.auth_key_secret(name), self.namespace))
        gone = await self._delete_objects(name)
        if node_id or stored is not None:
            again = await self.phases.cleanup.run(
                obj, lambda: self._forget_node(obj, node_id, stored),
                what=f"Headscale node {node_id or '(unknown)'}"
                + (f" and pre-auth key {stored.prefix}" if stored else ""),
                reason="NodeNotDeleted", hint="delete it by hand (headscale nodes delete)")
            if again is not None:
                return again
        await self.phases.events.normal(obj, "Deleted",
                                        f"deletionPolicy Delete: deleted {', '.join(gone) or 'no objects'}"
                                        + (f" and Headscale node {node_id}" if node_id else ""), action="Delete")
        return None

    async def _delete_objects(self, name: str) -> list[str]:
        """Delete everything the gateway made; names what was there."""
        gone = []
        for resource, what in gateway_objects(name):
            with contextlib.suppress(NotFound):
                await self.phases.writer.delete(resource, what, self.namespace)
                gone.append(f"{resource.kind} {what}")
        return gone

    async def _forget_node(self, obj: JSON, node_id: str, stored: AuthKey | None) -> None:
        """Delete the receipts' node and expire a pre-auth key not used yet."""
        async with self.phases.access.open(self.phases.tailnet_connection(obj)) as hs:
            if stored is not None:
                await self.phases.keys.expire(hs, stored)
            if node_id:
                with contextlib.suppress(HeadscaleNotFound):
                    await hs.delete_node(node_id)


def _node_id(obj: JSON) -> str:
    return str(((obj.get("status") or {}).get("receipts") or {}).get("nodeId") or "")
