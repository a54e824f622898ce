"""The IngressClass: an ``Ingress`` of a class whose controller is ``tailnet.dev/ingress-controller``
(and whose parameters name a Tailnet) becomes a tailnet node serving its rules over HTTPS.

The Ingress is served as the TailnetIngress
:func:`~tailnet_operator.resources.ingressclass.as_ingress` makes of it, through the same pipeline
(:mod:`.pipeline`) and the same parts as a TailnetIngress (:class:`.ingress.IngressNode`,
composed), exactly as the LoadBalancer class serves a Service (:mod:`.loadbalancer`): tenancy, the
tag pre-check, the pre-auth key (recorded in the operator's namespace), the agent's objects in the
Ingress's namespace (owned by the Ingress) and the hostname's succession. What the Ingress adds:

* an Ingress is acted on only while its class (or the cluster's default class, for an Ingress
  without one) is a tailnet class (:func:`~tailnet_operator.resources.ingressclass.tailnet_of`);
  every other Ingress is read from the cache and left alone;
* status: ``status.loadBalancer.ingress`` (the MagicDNS name as ``hostname``, each tailnet address
  as ``ip``), nothing else: an Ingress's status has no conditions (:class:`IngressStatus` shapes the
  write). What the conditions would say goes to Events on the Ingress instead: when Ready changes,
  a Normal ``Serving`` or a Warning with the reason (``HostWithoutTLS``, ``BackendPortNotFound``,
  ``TagNotOwned``, ...) and a message that says what to change;
* release when the class goes or the Ingress is being deleted (:class:`~.classed.ClassedReconciler`).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.resources import ingress as build
from tailnet_operator.resources import ingressclass as ic
from tailnet_operator.runtime import SERVICE, Reader, Request, Resource, Writer
from tailnet_operator.types import JSON

from .access import Deps
from .classed import ClassedReconciler, shape_objects
from .conditions import Cond
from .egress_status import AgentStatusReader, HttpAgentStatus
from .ingress import IngressNode, IngressSettings
from .kinds import INGRESS, INGRESS_CLASS
from .loadbalancer import ServiceStatus
from .pipeline import Outcome, Run
from .policy import ingresses_of_classes
from .shaped import ShapedNode

__all__ = ["CONDITION_TYPES", "FIELD_MANAGER", "IngressClassNode", "IngressClasses", "IngressStatus",
           "ingressclass_reconciler", "ingresses_of_class", "ingresses_of_tailnet"]

log = structlog.get_logger("controllers.ingressclass")

FIELD_MANAGER = "tailnet-operator-ingressclass"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "ExposesReady", "HostnameAssigned")


def ingressclass_reconciler(deps: Deps, writer: Writer, settings: IngressSettings, *,
                            agent_status: AgentStatusReader | None = None) -> ClassedReconciler:
    """The IngressClass's reconciler; writes as :data:`FIELD_MANAGER` through ``writer``."""
    shaped = IngressStatus(writer, deps)
    ingress = IngressNode(deps, shaped, settings, agent_status or HttpAgentStatus(service=build.agent_name))
    node = IngressClassNode(deps, shaped, settings, ingress)
    return ClassedReconciler(deps, shaped, node, IngressClasses(deps.reader))


# -- which Ingresses are the class's ----------------------------------------------------------------


def ingresses_of_class(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from an IngressClass to the Ingresses that use it (its Tailnet, its default mark)."""
    return lambda obj: _requests(ingresses_of_classes(reader, [obj]))


def ingresses_of_tailnet(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Tailnet to the Ingresses of its classes (its URL, CA or working key reaches them)."""

    def mapper(obj: JSON) -> list[Request]:
        name = obj["metadata"]["name"]
        return _requests(ingresses_of_classes(reader, [c for c in reader.list(INGRESS_CLASS)
                                                       if ic.tailnet_of_class(c) == name]))

    return mapper


def _requests(objs: list[JSON]) -> list[Request]:
    return [Request(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs]


class IngressClasses:
    """The Ingress as a classed object (:class:`~.classed.Classed`): its class read from the cache."""

    resource = INGRESS
    field_manager = FIELD_MANAGER
    released = ("IngressReleased", (
        "the Ingress no longer has a tailnet IngressClass: what the operator made for it is gone (its pre-auth key "
        "expired, its agent's objects deleted, its status cleared)"))

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def tailnet_of(self, obj: JSON) -> str | None:
        return ic.tailnet_of(obj, self.reader.list(INGRESS_CLASS))

    def named_objects(self, obj: JSON) -> list[tuple[Resource, str]]:
        return shape_objects(ic.object_name_of(str(obj["metadata"]["name"])))

    def idle(self, obj: JSON) -> bool:
        return False


# -- the status an Ingress can hold -----------------------------------------------------------------


class IngressStatus(ServiceStatus):
    """A Writer that shapes status writes to an Ingress to ``status.loadBalancer`` (all an Ingress's
    status holds) and tells a change of the Ready condition it drops as an Event on the Ingress
    (once per change while the operator runs)."""

    def __init__(self, writer: Writer, deps: Deps) -> None:
        super().__init__(writer)
        self.reader, self.events = deps.reader, deps.events
        self._told: dict[str, tuple[str, str, str]] = {}
        """By the Ingress's uid: the Ready (status, reason, message) last told (forgotten on release)."""

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        if resource == INGRESS:
            await self._tell(body)
        return await super().apply_status(resource, body, field_manager=field_manager)

    @staticmethod
    def shaped(resource: Resource, body: JSON) -> JSON:
        if resource != INGRESS:
            return ServiceStatus.shaped(resource, body)
        balancer = (body.get("status") or {}).get("loadBalancer")
        return {**body, "status": {"loadBalancer": balancer} if balancer is not None else {}}

    async def _tell(self, body: JSON) -> None:
        ready = next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
        meta = body.get("metadata") or {}
        obj = self.reader.get(INGRESS, meta.get("name", ""), meta.get("namespace"))
        if obj is None:
            return
        uid = str(obj["metadata"].get("uid"))
        if ready is None:  # released: nothing more to tell about it
            self._told.pop(uid, None)
            return
        told = (str(ready.get("status")), str(ready.get("reason")), str(ready.get("message")))
        if self._told.get(uid) == told:
            return
        self._told[uid] = told
        if told[0] == "True":
            await self.events.normal(obj, told[1], told[2], action="Serve")
        else:
            await self.events.warning(obj, told[1], told[2], action="Admit")


# -- the kind ----------------------------------------------------------------------------------------


class IngressClassNode(ShapedNode[ic.IngressObject]):
    """What an Ingress of the class adds to the pipeline: its TailnetIngress shape, served by the
    ingress's parts (:class:`~.shaped.ShapedNode`), and its status in the Ingress's terms."""

    resource = INGRESS
    model = ic.IngressObject
    field_manager = FIELD_MANAGER
    condition_types: tuple[str, ...] = CONDITION_TYPES

    def record_name(self, namespace: str, name: str) -> str:
        return ic.record_name(namespace, name)

    def shape_of(self, cr: ic.IngressObject) -> TailnetIngress:
        """Raises :class:`~tailnet_operator.resources.ingressclass.Problem` for one that cannot be served."""
        return ic.as_ingress(cr, self.tailnet_name(cr),
                             ic.ports_of(lambda name: self.reader.get(SERVICE, name, cr.namespace)))

    def spec_problem(self, run: Run[ic.IngressObject]) -> tuple[str, str] | None:
        try:
            self.shape_of(run.cr)
        except ic.Problem as problem:
            return problem.reason, problem.message
        return None

    def tailnet_name(self, cr: ic.IngressObject) -> str:
        spec = {"ingressClassName": cr.spec.ingress_class_name} if cr.spec.ingress_class_name else {}
        return ic.tailnet_of({"spec": spec}, self.reader.list(INGRESS_CLASS)) or ""

    def tag(self, cr: ic.IngressObject) -> str:
        return cr.tag

    def key_metadata(self, run: Run[ic.IngressObject]) -> JSON:
        return ic.record_metadata(run.cr, self.tailnet_name(run.cr), self.settings.operator_namespace)

    async def report(self, run: Run[ic.IngressObject], outcome: Outcome) -> tuple[list[Cond], JSON]:
        result, nodes = await self.served(run, outcome)
        node = result.fields.get("node")
        await self.ingress.record_node(self.key_location(run.obj), outcome.key, node, nodes)
        conds = [c for c in result.conditions if c.type in CONDITION_TYPES]
        return [*conds, _ready(result.conditions, node)], {"loadBalancer": ic.ingress_status(node)}


def _ready(found: list[Cond], node: JSON | None) -> Cond:
    """Ready in an Ingress's terms: the ingress's Ready, and where the Ingress is served once it is."""
    ready = next(c for c in found if c.type == "Ready")
    if ready.status != "True":
        return ready
    entries = ic.ingress_status(node).get("ingress") or []
    where = ", ".join(str(e.get("hostname") or e["ip"]) for e in entries) or "its node (no address yet)"
    return Cond("Ready", "True", "Serving", f"served on the tailnet at {where}")
