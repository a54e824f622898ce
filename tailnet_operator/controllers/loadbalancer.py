"""The LoadBalancer class: a Service of ``type: LoadBalancer`` and ``loadBalancerClass:
tailnet.dev/<tailnet>`` becomes a tailnet node exposing its TCP ports.

The Service is served as the TailnetIngress :func:`~tailnet_operator.resources.loadbalancer.as_ingress`
makes of it, through the same pipeline (:mod:`.pipeline`) and the same parts as a TailnetIngress
(:class:`.ingress.IngressNode`, composed): tenancy, the tag pre-check against the live policy, the
pre-auth key (recorded in the operator's namespace), the agent's objects in the Service's namespace
(owned by the Service) and the hostname's succession. What the Service adds:

* a Service is acted on only while :func:`~tailnet_operator.resources.loadbalancer.tailnet_of`
  names a Tailnet for it (the watch filter, :data:`CLASSED`); every other Service is never read;
* status: ``status.loadBalancer.ingress`` (the MagicDNS name as ``hostname``, each tailnet
  address as ``ip``) and the pipeline's conditions (Ready, TagOwned, PreAuthKeyValid,
  ExposesReady, HostnameAssigned, and :data:`PORTS_SUPPORTED`) in ``status.conditions``; nothing
  else, since a Service's status has no other fields (:class:`ServiceStatus` shapes the write);
* Events: the pipeline's (refusals as Warnings, key rotation, node renames), and a Warning
  ``PortsSkipped`` when a UDP or SCTP port is left out (once, when it changes);
* release: when the class goes (a type other than LoadBalancer wipes it) or the Service is being
  deleted, the key is expired (bounded like every finalizer: :mod:`.cleanup`), the record deleted,
  and, for a Service that stays, the agent's objects deleted and the status this controller wrote
  removed, before the finalizer comes off (:class:`~.classed.ClassedReconciler`).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.headscale import Node
from tailnet_operator.resources import ingress as build
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.runtime import SECRET, SERVICE, Reader, Request, Resource, Writer
from tailnet_operator.types import JSON

from . import conditions
from .access import Deps
from .classed import ClassedReconciler, shape_objects
from .conditions import Cond
from .egress_status import AgentStatusReader, HttpAgentStatus
from .ingress import IngressNode, IngressSettings
from .ingress_status import own_nodes
from .keyrecord import NODE_IDS
from .pipeline import Outcome, Run
from .policy import TAILNET_INDEX
from .preauth import AuthKey
from .shaped import ShapedNode

__all__ = ["CLASSED", "CONDITION_TYPES", "FIELD_MANAGER", "PORTS_SUPPORTED", "LoadBalancedServices",
           "LoadBalancerReconciler", "ServiceNode", "ServiceStatus", "loadbalancer_reconciler", "services_of_tailnet"]

log = structlog.get_logger("controllers.loadbalancer")

FIELD_MANAGER = "tailnet-operator-loadbalancer"
NODE_FIELD_MANAGER = "tailnet-operator-loadbalancer-node"
"""Writes the ids of the Service's nodes onto its record, apart from the key bookkeeping."""
PORTS_SUPPORTED = "PortsSupported"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "ExposesReady", "HostnameAssigned", PORTS_SUPPORTED)
STATUS_FIELDS = ("conditions", "loadBalancer")
"""What a Service's status can hold of what the pipeline writes."""


def loadbalancer_reconciler(deps: Deps, writer: Writer, settings: IngressSettings, *,
                            agent_status: AgentStatusReader | None = None) -> LoadBalancerReconciler:
    """The LoadBalancer class's reconciler; writes as :data:`FIELD_MANAGER` through ``writer``."""
    shaped = ServiceStatus(writer)
    ingress = IngressNode(deps, shaped, settings, agent_status or HttpAgentStatus(service=build.agent_name))
    return ClassedReconciler(deps, shaped, ServiceNode(deps, shaped, settings, ingress), LoadBalancedServices())


# -- the watch filter -----------------------------------------------------------------------------


def _served_part(obj: JSON) -> tuple[object, ...]:
    meta = obj.get("metadata") or {}
    return obj.get("spec"), meta.get("annotations"), meta.get("deletionTimestamp")


class _Classed:
    """Passes a Service with a tailnet class, and the update that takes the class away; of the
    updates, only those that change what is served (spec, annotations, deletion): the
    controller's own status writes wake nothing."""

    def create(self, obj: JSON) -> bool:
        return lb.tailnet_of(obj) is not None

    def update(self, old: JSON, new: JSON) -> bool:
        classed = lb.tailnet_of(old) is not None or lb.tailnet_of(new) is not None
        return classed and _served_part(old) != _served_part(new)

    def delete(self, obj: JSON) -> bool:
        return lb.tailnet_of(obj) is not None


CLASSED = _Classed()


def services_of_tailnet(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Tailnet to the Services of its class (its URL, CA or working key reaches them)."""

    def mapper(obj: JSON) -> list[Request]:
        name = obj["metadata"]["name"]
        return [Request(s["metadata"]["namespace"], s["metadata"]["name"])
                for s in reader.list(SERVICE, index=(TAILNET_INDEX, name))]

    return mapper


# -- the status a Service can hold -----------------------------------------------------------------


class ServiceStatus:
    """A Writer that shapes status writes to a Service: the pipeline writes a CR's status
    (``preAuthKey``, ``observedGeneration``, ...), of which a Service's status holds only
    :data:`STATUS_FIELDS`. Everything else passes through unchanged."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer

    async def apply(self, resource: Resource, body: JSON, *, subresource: str | None = None,
                    force: bool = True, field_manager: str | None = None) -> JSON:
        if subresource == "status":
            body = self.shaped(resource, body)
        return await self.writer.apply(resource, body, subresource=subresource, force=force,
                                       field_manager=field_manager)

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        return await self.writer.apply_status(resource, self.shaped(resource, body), field_manager=field_manager)

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     propagation: str | None = None) -> JSON:
        return await self.writer.delete(resource, name, namespace, uid=uid, resource_version=resource_version,
                                        propagation=propagation)

    @staticmethod
    def shaped(resource: Resource, body: JSON) -> JSON:
        if resource != SERVICE:
            return body
        status = body.get("status") or {}
        return {**body, "status": {k: v for k, v in status.items() if k in STATUS_FIELDS}}


# -- the kind ------------------------------------------------------------------------------------


class ServiceNode(ShapedNode[lb.LoadBalancerService]):
    """What a LoadBalancer Service adds to the pipeline: its TailnetIngress shape, served by the
    ingress's parts (:class:`~.shaped.ShapedNode`), and its status in the Service's own terms."""

    resource = SERVICE
    model = lb.LoadBalancerService
    field_manager = FIELD_MANAGER
    condition_types: tuple[str, ...] = CONDITION_TYPES

    def record_name(self, namespace: str, name: str) -> str:
        return lb.record_name(namespace, name)

    def shape_of(self, cr: lb.LoadBalancerService) -> TailnetIngress:
        return lb.as_ingress(cr)

    def spec_problem(self, run: Run[lb.LoadBalancerService]) -> tuple[str, str] | None:
        return lb.problem(run.cr)

    def tailnet_name(self, cr: lb.LoadBalancerService) -> str:
        return cr.tailnet

    def tag(self, cr: lb.LoadBalancerService) -> str:
        return cr.tag

    def key_metadata(self, run: Run[lb.LoadBalancerService]) -> JSON:
        return lb.record_metadata(run.cr, self.settings.operator_namespace)

    async def report(self, run: Run[lb.LoadBalancerService], outcome: Outcome) -> tuple[list[Cond], JSON]:
        result, nodes = await self.served(run, outcome)
        await self._record_nodes(run, outcome.key, nodes)
        conds = [c for c in result.conditions if c.type in CONDITION_TYPES]
        node = result.fields.get("node")
        return [*conds, _ready(result.conditions, node), await self._ports(run)], \
            {"loadBalancer": lb.load_balancer_status(node)}

    async def _ports(self, run: Run[lb.LoadBalancerService]) -> Cond:
        """PortsSupported, and a Warning Event ``PortsSkipped`` when the skipped ports change."""
        skipped = lb.skipped_ports(run.cr)
        if not skipped:
            return Cond(PORTS_SUPPORTED, "True", "AllTCP", "every port of the Service is TCP and served")
        message = (f"skipped {', '.join(p.describe() for p in skipped)}: the tailnet node forwards TCP only; "
                   f"serving {', '.join(p.describe() for p in lb.tcp_ports(run.cr))}")
        cond = Cond(PORTS_SUPPORTED, "False", "PortsSkipped", message)
        before = conditions.get((run.obj.get("status") or {}).get("conditions"), PORTS_SUPPORTED) or {}
        if before.get("message") != message:
            await self.events.warning(run.obj, "PortsSkipped", message, action="Expose")
        return cond

    async def _record_nodes(self, run: Run[lb.LoadBalancerService], key: AuthKey, nodes: list[Node]) -> None:
        """Note on the record the ids of the Service's nodes, which stay its own after their key is
        retired (succession, revocation)."""
        name, namespace = self.key_location(run.obj)
        record = self.reader.get(SECRET, name, namespace) or {}
        notes = (record.get("metadata") or {}).get("annotations") or {}
        ids = ",".join(sorted(n.id for n in own_nodes(key, nodes)))
        if notes.get(NODE_IDS, "") == ids:
            return
        annotations = {NODE_IDS: ids} if ids else {}
        await self.writer.apply(SECRET, {"metadata": {"name": name, "namespace": namespace,
                                                      "annotations": annotations}},
                                field_manager=NODE_FIELD_MANAGER)


def _ready(found: list[Cond], node: JSON | None) -> Cond:
    """Ready in a Service's terms: the ingress's Ready, and where the Service is served once it is."""
    ready = next(c for c in found if c.type == "Ready")
    if ready.status != "True":
        return ready
    exposes = next(c for c in found if c.type == "ExposesReady")
    entries = lb.load_balancer_status(node).get("ingress") or []
    where = ", ".join(str(e.get("hostname") or e["ip"]) for e in entries) or "its node (no address yet)"
    return Cond("Ready", "True", "Serving", f"served on the tailnet at {where}; {exposes.message}")


# -- the classed object -------------------------------------------------------------------------


class LoadBalancedServices:
    """The Service as a classed object (:class:`~.classed.Classed`)."""

    resource = SERVICE
    field_manager = FIELD_MANAGER
    released = ("LoadBalancerReleased", (
        "the Service no longer has a tailnet loadBalancerClass: what the operator made for it is gone (its "
        "pre-auth key expired, its agent's objects deleted, its status cleared)"))

    def tailnet_of(self, obj: JSON) -> str | None:
        return lb.tailnet_of(obj)

    def named_objects(self, obj: JSON) -> list[tuple[Resource, str]]:
        """The agent's key Secret and exposes ConfigMap of a Service, by its name alone."""
        return shape_objects(lb.object_name_of(str(obj["metadata"]["name"])))

    def idle(self, obj: JSON) -> bool:
        return False


LoadBalancerReconciler = ClassedReconciler
"""Serves a classed Service through the pipeline; releases one whose class went or that is being
deleted (:mod:`.classed`)."""
