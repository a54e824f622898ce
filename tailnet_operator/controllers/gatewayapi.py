"""The Gateway API: a ``Gateway`` whose GatewayClass has ``controllerName:
tailnet.dev/gateway-controller`` (and a ``parametersRef`` naming a Tailnet) becomes a tailnet node
serving the HTTPRoutes, GRPCRoutes, TLSRoutes and TCPRoutes attached to it.

The Gateway is served as the TailnetIngress
:func:`~tailnet_operator.resources.gatewayapi.as_ingress` makes of it and its routes, through the
same pipeline (:mod:`.pipeline`) and the same parts as a TailnetIngress (:class:`.ingress.IngressNode`,
composed), exactly as the IngressClass serves an Ingress (:mod:`.ingressclass`): tenancy, the tag
pre-check, the pre-auth key (recorded in the operator's namespace), the agent's objects in the
Gateway's namespace (owned by the Gateway) and the hostname's succession. What the Gateway adds:

* a Gateway is acted on only while its class is a tailnet class; every other Gateway is read from
  the cache and left alone. The annotations ``tailnet.dev/hostname`` and ``tailnet.dev/tag`` are
  the LoadBalancer class's, with the same defaults and the same tenancy;
* status in the Gateway API's terms (:class:`GatewayStatus`): ``Accepted`` and each listener's
  conditions as the translation says, ``Programmed`` once the node serves (else ``Pending``, with
  the pipeline's reason and message: ``TagNotOwned``, ``NamespaceNotGranted``, ...), the node's
  tailnet addresses and MagicDNS name in ``status.addresses``, and each attached HTTPRoute's
  ``status.parents`` entry (other controllers' entries kept);
* a Gateway is served once one of its listeners can be: an HTTP or HTTPS listener no route is
  attached to yet listens and answers 404 (so the Gateway is Programmed, with its addresses, before
  its first route); a TLS or TCP listener listens once a route is served on it, and a Gateway of
  such listeners alone with no route served is a node with no port open, Programmed with its
  addresses (when its last route goes, the port closes: nothing goes on forwarding); a Gateway none
  of whose listeners can be served is ``Accepted: False`` (``ListenersNotValid``) and has no node;
* the GatewayClass's own ``Accepted`` and ``supportedFeatures`` (:class:`GatewayClassReconciler`);
* release when the class goes or the Gateway is being deleted (:class:`~.classed.ClassedReconciler`),
  its entries taken off the routes that name it.

The Gateway API's CRDs are installed apart from the operator: until they are, the cache holds
none of these kinds and the controllers have nothing to do (the informers look for the CRDs every
30 s, so installing them later needs no restart).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from pydantic import ValidationError

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.resources import gatewayapi as gw
from tailnet_operator.resources import ingress as build
from tailnet_operator.runtime import (
    SECRET,
    Clock,
    Reader,
    Request,
    Resource,
    Result,
    Writer,
    needs_apply,
)
from tailnet_operator.types import JSON

from . import conditions, periods
from .access import Deps
from .applier import Desired
from .classed import ClassedReconciler, shape_objects
from .conditions import Cond, rfc3339
from .egress_status import AgentStatusReader, HttpAgentStatus
from .gatewayapi_plans import Plans, parent_index
from .ingress import IngressNode, IngressSettings
from .kinds import API_GATEWAY, GATEWAY_CLASS, ROUTE_RESOURCES, TAILNET
from .loadbalancer import ServiceStatus
from .pipeline import NotReady, Outcome, Run
from .preauth import AuthKey
from .shaped import ShapedNode
from .status import StatusWriter

__all__ = [
    "CLASS_FIELD_MANAGER",
    "CONDITION_TYPES",
    "FIELD_MANAGER",
    "GatewayClassReconciler",
    "GatewayNode",
    "GatewayStatus",
    "Gateways",
    "classes_of_tailnet",
    "gatewayapi_reconciler",
    "gateways_near",
    "gateways_of_class",
    "gateways_of_grant",
    "gateways_of_route",
    "gateways_of_tailnet",
    "gateways_selecting_namespaces",
    "gateways_using_secret",
]

log = structlog.get_logger("controllers.gatewayapi")

FIELD_MANAGER = "tailnet-operator-gatewayapi"
CLASS_FIELD_MANAGER = "tailnet-operator-gatewayclass"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "ExposesReady", "HostnameAssigned")


def gatewayapi_reconciler(deps: Deps, writer: Writer, settings: IngressSettings, *,
                          agent_status: AgentStatusReader | None = None) -> ClassedReconciler:
    """The Gateway API's reconciler; writes as :data:`FIELD_MANAGER` through ``writer``."""
    plans = Plans(deps.reader)
    shaped = GatewayStatus(writer, deps.reader, deps.clock, plans)
    ingress = IngressNode(deps, shaped, settings, agent_status or HttpAgentStatus(service=build.agent_name))
    return ClassedReconciler(deps, shaped, GatewayNode(deps, shaped, settings, ingress, plans),
                             Gateways(deps.reader, plans))


# -- what the cache answers ------------------------------------------------------------------------


def _requests(objs: list[JSON]) -> list[Request]:
    return [Request(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs]


_ROUTE_KINDS = {kind.kind: kind for kind in ROUTE_RESOURCES}


def gateways_of_route(obj: JSON) -> list[Request]:
    """A mapper from a route (of any kind) to the Gateways it names (its change is theirs to serve)."""
    return [Request(*key.split("/", 1)) for key in parent_index(obj)]


def gateways_of_class(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a GatewayClass to its Gateways."""
    def mapper(obj: JSON) -> list[Request]:
        name = obj["metadata"]["name"]
        return _requests([g for g in reader.list(API_GATEWAY) if (g.get("spec") or {}).get("gatewayClassName") == name])

    return mapper


def gateways_of_tailnet(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Tailnet to the Gateways of its classes (its URL, CA or working key reaches them)."""
    def mapper(obj: JSON) -> list[Request]:
        classes = reader.list(GATEWAY_CLASS)
        return _requests([g for g in reader.list(API_GATEWAY) if gw.tailnet_of(g, classes) == obj["metadata"]["name"]])

    return mapper


def gateways_near(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Service to the Gateways of its namespace (a backend appearing or going)."""
    return lambda obj: _requests(reader.list(API_GATEWAY, obj["metadata"].get("namespace")))


def gateways_of_grant(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a ReferenceGrant to the Gateways it may concern: those of the namespaces it
    lets Gateways refer from (a certificate), and those the HTTPRoutes of the namespaces it lets
    routes refer from name (a backend)."""
    def mapper(obj: JSON) -> list[Request]:
        found: set[tuple[str, str]] = set()
        for entry in (obj.get("spec") or {}).get("from") or []:
            namespace = str(entry.get("namespace") or "")
            if entry.get("kind") == "Gateway":
                found |= {(namespace, g["metadata"]["name"]) for g in reader.list(API_GATEWAY, namespace)}
            elif (kind := _ROUTE_KINDS.get(str(entry.get("kind")))) is not None:
                for route in reader.list(kind, namespace):
                    found |= {(key.split("/", 1)[0], key.split("/", 1)[1]) for key in parent_index(route)}
        return [Request(ns, name) for ns, name in sorted(found)]

    return mapper


def gateways_selecting_namespaces(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Namespace (its labels changed) to the Gateways with a listener that
    admits routes by a namespace selector."""
    def selects(gateway: JSON) -> bool:
        return any(((ls.get("allowedRoutes") or {}).get("namespaces") or {}).get("from") == "Selector"
                   for ls in (gateway.get("spec") or {}).get("listeners") or [])

    return lambda _: _requests([g for g in reader.list(API_GATEWAY) if selects(g)])


def gateways_using_secret(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Secret to the Gateways of its namespace whose listeners name it as a
    certificate (it appearing, changing or going)."""
    def mapper(obj: JSON) -> list[Request]:
        meta = obj["metadata"]
        key = (meta.get("namespace") or "", meta["name"])
        return _requests([g for g in reader.list(API_GATEWAY, key[0]) if key in gw.certificate_secrets(g)])

    return mapper


def classes_of_tailnet(reader: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Tailnet to the GatewayClasses that name it (it appearing or going)."""
    def mapper(obj: JSON) -> list[Request]:
        name = obj["metadata"]["name"]
        return [Request("", c["metadata"]["name"]) for c in reader.list(GATEWAY_CLASS)
                if gw.tailnet_of_class(c) == name]

    return mapper


class Problem(Exception):
    """A Gateway that cannot be served: a CamelCase reason and a message that says what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.reason, self.message = reason, message


# -- the status a Gateway holds --------------------------------------------------------------------


class GatewayStatus(ServiceStatus):
    """A Writer that turns the pipeline's status writes to a Gateway into the Gateway API's status
    (module docstring) and writes the ``status.parents`` of the routes that name it; an empty
    status (a release) takes this controller's entries off those routes."""

    def __init__(self, writer: Writer, reader: Reader, clock: Clock, plans: Plans) -> None:
        super().__init__(writer)
        self.reader, self.clock, self.plans = reader, clock, plans

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        if resource != API_GATEWAY:
            return await super().apply_status(resource, body, field_manager=field_manager)
        meta = body.get("metadata") or {}
        obj = self.reader.get(API_GATEWAY, meta.get("name", ""), meta.get("namespace"))
        status = body.get("status") or {}
        if obj is None:
            return body
        now = rfc3339(self.clock.utcnow())
        if "conditions" not in status:  # released
            await self._parents(obj, {}, now)
            return await self.writer.apply_status(resource, body, field_manager=field_manager)
        new, plan = self._status(obj, status, now)
        await self._parents(obj, plan.parents if plan is not None else {}, now)
        written = {"metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")}, "status": new}
        if not needs_apply(written, obj, manager=field_manager or FIELD_MANAGER, subresource="status"):
            return obj
        return await self.writer.apply_status(resource, written, field_manager=field_manager)

    def _status(self, obj: JSON, status: JSON, now: str) -> tuple[JSON, gw.GatewayPlan | None]:
        """The Gateway's status from the pipeline's (``status``: its Ready and the node), and the
        plan it follows (None for a Gateway whose annotations are not valid)."""
        ready = conditions.get(status.get("conditions"), "Ready") or {}
        try:
            served = gw.ServedGateway.model_validate(obj)
        except ValidationError:
            return {"conditions": [{"type": "Accepted", "status": "False", "reason": "Invalid",
                                    "message": str(ready.get("message") or "the Gateway is not valid"),
                                    "observedGeneration": int(obj["metadata"].get("generation") or 0),
                                    "lastTransitionTime": now}]}, None
        plan = self.plans.plan(served)
        waiting = "" if ready.get("status") == "True" else f"{ready.get('reason')}: {ready.get('message')}"
        return gw.gateway_status(plan, served.gateway, status.get("node"), ready=ready.get("status") == "True",
                                 current=obj.get("status"), now=now, waiting=waiting), plan

    async def _parents(self, obj: JSON, results: dict[gw.RouteKey, list[gw.ParentResult]], now: str) -> None:
        meta = obj["metadata"]
        for kind, route in self.plans.routes(meta["namespace"], meta["name"]):
            key = (kind.kind, route["metadata"]["namespace"], route["metadata"]["name"])
            named = [r for r in (route.get("status") or {}).get("parents") or []
                     if r.get("controllerName") == gw.CONTROLLER
                     and (r.get("parentRef") or {}).get("name") == meta["name"]
                     and (r.get("parentRef") or {}).get("namespace", key[1]) == meta["namespace"]]
            parents = gw.route_parents(route, results.get(key, []), now=now)
            if key not in results:  # this Gateway no longer speaks for the route
                parents = [p for p in parents if p not in named]
            body = {"metadata": {"name": key[2], "namespace": key[1]}, "status": {"parents": parents}}
            if needs_apply(body, route, manager=FIELD_MANAGER, subresource="status"):
                await self.writer.apply_status(kind, body, field_manager=FIELD_MANAGER)


# -- the kind --------------------------------------------------------------------------------------


class GatewayNode(ShapedNode[gw.ServedGateway]):
    """What a Gateway of a tailnet class adds to the pipeline: its TailnetIngress shape (from its
    listeners and routes), served by the ingress's parts, and its status in the Gateway API's terms."""

    resource = API_GATEWAY
    model = gw.ServedGateway
    field_manager = FIELD_MANAGER
    condition_types: tuple[str, ...] = CONDITION_TYPES

    def __init__(self, deps: Deps, writer: Writer, settings: IngressSettings, ingress: IngressNode,
                 plans: Plans) -> None:
        super().__init__(deps, writer, settings, ingress)
        self.plans = plans

    def record_name(self, namespace: str, name: str) -> str:
        return gw.record_name(namespace, name)

    def shape_of(self, cr: gw.ServedGateway) -> TailnetIngress:
        """Raises :class:`Problem` for a Gateway with nothing the node can serve."""
        plan = self.plans.plan(cr)
        if plan.ingress is None:
            raise Problem(plan.accepted.reason, plan.accepted.message)
        return plan.ingress

    def spec_problem(self, run: Run[gw.ServedGateway]) -> tuple[str, str] | None:
        if (found := gw.gateway_name_problem(run.cr.name)) is not None:
            return found
        plan = self.plans.plan(run.cr)
        if plan.ingress is None and plan.unresolved:
            # Refused for want of a Secret, not for its spec: looked for again (periods.REFERENCE_RETRY).
            raise NotReady("False", plan.accepted.reason, plan.accepted.message,
                           requeue_after=periods.REFERENCE_RETRY)
        if plan.ingress is None:
            return plan.accepted.reason, plan.accepted.message
        return None

    def tailnet_name(self, cr: gw.ServedGateway) -> str:
        return self.plans.tailnet({"spec": {"gatewayClassName": cr.spec.gateway_class_name}})

    def desired(self, run: Run[gw.ServedGateway], key: AuthKey) -> Desired:
        """The ingress's agent objects, and a copy in the Gateway's namespace of each certificate of
        another namespace a ReferenceGrant lets it use (the plan served it only if it is valid)."""
        wanted = super().desired(run, key)
        copies = [(SECRET, gw.certificate_copy(run.obj, str(run.tailnet.metadata.name), namespace, source))
                  for namespace, name in gw.cross_namespace_certificates(run.obj)
                  if (source := self.reader.get(SECRET, name, namespace)) is not None
                  and gw.certificate_problem(source) is None]
        return Desired.of(*wanted.wants, *copies, prune=wanted.prune)

    def tag(self, cr: gw.ServedGateway) -> str:
        return cr.tag

    def key_metadata(self, run: Run[gw.ServedGateway]) -> JSON:
        return gw.record_metadata(run.cr, self.tailnet_name(run.cr), self.settings.operator_namespace)

    async def report(self, run: Run[gw.ServedGateway], outcome: Outcome) -> tuple[list[Cond], JSON]:
        result, nodes = await self.served(run, outcome)
        node = result.fields.get("node")
        await self.ingress.record_node(self.key_location(run.obj), outcome.key, node, nodes)
        conds = [c for c in result.conditions if c.type in CONDITION_TYPES]
        return [*conds, _programmed(result.conditions, result.fields.get("exposes") or [])], {"node": node}


def _programmed(found: list[Cond], exposes: list[JSON]) -> Cond:
    """Ready as the Gateway's Programmed reads it: the node listens on every port with its
    certificates. A backend that does not answer the agent's probe is the routes' business
    (ResolvedRefs says whether it exists), not the Gateway's, and the probed backend of a port no
    route serves yet is one no request reaches (every request gets 404)."""
    ready = next(c for c in found if c.type == "Ready")
    if ready.reason != "BackendUnreachable" or not all(e.get("ready") or e.get("reason") == "BackendUnreachable"
                                                           for e in exposes):
        return ready
    return Cond("Ready", "True", "Serving", f"listening; {ready.message}")


class Gateways:
    """The Gateway as a classed object (:class:`~.classed.Classed`): its class read from the cache."""

    resource = API_GATEWAY
    field_manager = FIELD_MANAGER
    released = ("GatewayReleased", (
        "the Gateway's class is no longer a tailnet GatewayClass: what the operator made for it is gone (its "
        "pre-auth key expired, its agent's objects deleted, its status cleared)"))

    def __init__(self, reader: Reader, plans: Plans) -> None:
        self.reader, self.plans = reader, plans

    def tailnet_of(self, obj: JSON) -> str | None:
        return gw.tailnet_of(obj, self.reader.list(GATEWAY_CLASS))

    def idle(self, obj: JSON) -> bool:
        """Never: a Gateway with no route on its TLS and TCP listeners is a node with no port open,
        so that it has its addresses and is Programmed before its first route (the agent closes the
        port of a route that goes)."""
        return False

    def named_objects(self, obj: JSON) -> list[tuple[Resource, str]]:
        name = str(obj["metadata"]["name"])
        copies = [(SECRET, gw.certificate_copy_name(name, *ref)) for ref in gw.cross_namespace_certificates(obj)]
        return [*shape_objects(gw.object_name_of(name)), *copies]


# -- the class --------------------------------------------------------------------------------------


class GatewayClassReconciler:
    """Writes a tailnet GatewayClass's ``Accepted`` (its Tailnet exists) and ``supportedFeatures``;
    a class of another controller is never written to."""

    def __init__(self, reader: Reader, writer: Writer, clock: Clock) -> None:
        self.reader = reader
        self.status = StatusWriter(writer, clock, field_manager=CLASS_FIELD_MANAGER)

    async def reconcile(self, request: Request) -> Result:
        obj = self.reader.get(GATEWAY_CLASS, request.name)
        if obj is None or (obj.get("spec") or {}).get("controllerName") != gw.CONTROLLER:
            return Result()
        conds = [Cond(c.type, "True" if c.status else "False", c.reason, c.message)
                 for c in gw.class_conditions(obj, lambda name: self.reader.get(TAILNET, name) is not None)]
        features = [{"name": name} for name in gw.SUPPORTED_FEATURES]
        await self.status.write(GATEWAY_CLASS, obj, conds, {"supportedFeatures": features}, observed_generation=False)
        return Result()
