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
  removed, before the finalizer comes off (:class:`LoadBalancerReconciler`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import structlog

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import Node
from tailnet_operator.names import TAILNET_LABEL, auth_key_secret_name
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.derive import Derived
from tailnet_operator.resources import ingress as build
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Reader, Request, Resource, Result, Writer
from tailnet_operator.runtime.errors import Forbidden, NotFound
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.tenancy import Refusal
from tailnet_operator.types import JSON

from . import conditions, finalizer
from .access import Deps, NoAccess
from .applier import Applier, Desired, owned_by
from .conditions import Cond
from .egress_status import AgentStatusReader, HttpAgentStatus
from .ingress import IngressNode, IngressSettings
from .ingress_status import own_nodes, report
from .keyrecord import NODE_IDS
from .kinds import TAILNET_INGRESS
from .pipeline import NotReady, Outcome, Run, TaggedNodeReconciler
from .policy import TAILNET_INDEX
from .preauth import AuthKey

__all__ = ["CLASSED", "CONDITION_TYPES", "FIELD_MANAGER", "PORTS_SUPPORTED", "LoadBalancerReconciler",
           "ServiceNode", "ServiceStatus", "loadbalancer_reconciler", "services_of_tailnet"]

log = structlog.get_logger("controllers.loadbalancer")

FIELD_MANAGER = "tailnet-operator-loadbalancer"
NODE_FIELD_MANAGER = "tailnet-operator-loadbalancer-node"
"""Writes the ids of the Service's nodes onto its record, apart from the key bookkeeping."""
PORTS_SUPPORTED = "PortsSupported"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "ExposesReady", "HostnameAssigned", PORTS_SUPPORTED)
STATUS_FIELDS = ("conditions", "loadBalancer")
"""What a Service's status can hold of what the pipeline writes."""
LISTED_KINDS = (DEPLOYMENT, SERVICE, NETWORK_POLICY)
"""What a served Service owns in its namespace and the cache lists there: pruned when its class goes."""
SKIP_HINT = "expire it by hand (headscale preauthkeys expire), or let the orphan sweep do it"


def loadbalancer_reconciler(deps: Deps, writer: Writer, settings: IngressSettings, *,
                            agent_status: AgentStatusReader | None = None) -> LoadBalancerReconciler:
    """The LoadBalancer class's reconciler; writes as :data:`FIELD_MANAGER` through ``writer``."""
    shaped = ServiceStatus(writer)
    ingress = IngressNode(deps, shaped, settings, agent_status or HttpAgentStatus(service=build.agent_name))
    return LoadBalancerReconciler(deps, shaped, ServiceNode(deps, shaped, settings, ingress))


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


class ServiceNode:
    """What a LoadBalancer Service adds to the pipeline: its TailnetIngress shape, served by the
    ingress's parts, and its status in the Service's own terms."""

    resource = SERVICE
    model = lb.LoadBalancerService
    field_manager = FIELD_MANAGER
    condition_types: tuple[str, ...] = CONDITION_TYPES

    def __init__(self, deps: Deps, writer: Writer, settings: IngressSettings, ingress: IngressNode) -> None:
        self.reader, self.access, self.events = deps.reader, deps.access, deps.events
        self.writer = writer
        self.settings = settings
        self.ingress = ingress

    @staticmethod
    def shape(run: Run[lb.LoadBalancerService]) -> Run[TailnetIngress]:
        """The reconcile as the ingress's parts see it: the Service as stored, its TailnetIngress shape."""
        return Run(run.obj, lb.as_ingress(run.cr), run.tailnet)

    def accepts(self, request: Request) -> bool:
        return True

    def spec_problem(self, run: Run[lb.LoadBalancerService]) -> tuple[str, str] | None:
        return lb.problem(run.cr)

    def tailnet_name(self, cr: lb.LoadBalancerService) -> str:
        return cr.tailnet

    def tag(self, cr: lb.LoadBalancerService) -> str:
        return cr.tag

    def derived(self, cr: lb.LoadBalancerService) -> Derived:
        return derive_from_objects(ingresses=[lb.as_ingress(cr)])

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """The Service's record in the operator's namespace, which the Service's namespace cannot write."""
        meta = obj["metadata"]
        return lb.record_name(meta["namespace"], meta["name"]), self.settings.operator_namespace

    def key_metadata(self, run: Run[lb.LoadBalancerService]) -> JSON:
        return lb.record_metadata(run.cr, self.settings.operator_namespace)

    def refusal(self, run: Run[lb.LoadBalancerService], live_policy: str | None) -> Refusal | None:
        """The ingress's tenancy: the namespace, the tag (a reserved one only by its exact name)."""
        return self.ingress.refusal(self.shape(run), live_policy)

    def not_granted(self, run: Run[lb.LoadBalancerService], exc: Forbidden) -> str:
        return self.ingress.not_granted(self.shape(run), exc)

    def before_key(self, run: Run[lb.LoadBalancerService]) -> Desired:
        return self.ingress.before_key(self.shape(run))

    def desired(self, run: Run[lb.LoadBalancerService], key: AuthKey) -> Desired:
        """The ingress's agent objects for the shape, owned by the Service (no Certificate: tcp only)."""
        owner, ingress = run.obj, lb.as_ingress(run.cr)
        agent = build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                                auth_secret=auth_key_secret_name(TAILNET_INGRESS.kind, lb.object_name(run.cr)),
                                ca_bundle=self.access.agent_ca(run.tailnet),
                                operator_labels=self.settings.operator_labels,
                                metrics_namespaces=self.settings.metrics_namespaces)
        return Desired.of((SECRET, build.auth_secret(owner, ingress, key.key)),
                          (DEPLOYMENT, build.deployment(owner, ingress, agent)),
                          (SERVICE, build.agent_service(owner, ingress)),
                          (NETWORK_POLICY, build.network_policy(owner, ingress, agent,
                                                                self.settings.operator_namespace)))

    async def report(self, run: Run[lb.LoadBalancerService], outcome: Outcome) -> tuple[list[Cond], JSON]:
        shaped = self.shape(run)
        nodes = await self.ingress.free_hostname(shaped, outcome)
        agent = await self.ingress.agent_status.read(shaped.cr)
        result = report(shaped.cr, [], agent=agent, nodes=nodes, key=outcome.key, reader=self.reader,
                        issues={}, dns=False)
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


def _named_objects(obj: JSON) -> list[tuple[Resource, str]]:
    """The agent's key Secret and exposes ConfigMap of a Service, by its name alone (its spec may no
    longer be one the class serves)."""
    stem = lb.object_name_of(str(obj["metadata"]["name"]))
    return [(SECRET, auth_key_secret_name(TAILNET_INGRESS.kind, stem)),
            (CONFIG_MAP, lb.config_map_name_of(str(obj["metadata"]["name"])))]


def _wrote_status(obj: JSON) -> bool:
    """Whether this controller owns fields of the Service's status (a refusal before any finalizer,
    e.g. TailnetNotFound or NamespaceNotGranted, leaves only that)."""
    return any(m.get("manager") == FIELD_MANAGER and m.get("subresource") == "status"
               for m in obj["metadata"].get("managedFields") or [])


def _ready(found: list[Cond], node: JSON | None) -> Cond:
    """Ready in a Service's terms: the ingress's Ready, and where the Service is served once it is."""
    ready = next(c for c in found if c.type == "Ready")
    if ready.status != "True":
        return ready
    exposes = next(c for c in found if c.type == "ExposesReady")
    entries = lb.load_balancer_status(node).get("ingress") or []
    where = ", ".join(str(e.get("hostname") or e["ip"]) for e in entries) or "its node (no address yet)"
    return Cond("Ready", "True", "Serving", f"served on the tailnet at {where}; {exposes.message}")


# -- the reconciler ------------------------------------------------------------------------------


class LoadBalancerReconciler:
    """Serves a classed Service through the pipeline; releases one whose class went or that is
    being deleted (the pipeline's own deletion reads a CR's ``spec.tailnetRef``, which a Service
    has not: the Tailnet comes from the record's label instead)."""

    def __init__(self, deps: Deps, writer: Writer, node: ServiceNode) -> None:
        self.pipeline = TaggedNodeReconciler(deps, writer, node)
        self.phases = self.pipeline.phases
        self.node = node
        self.reader, self.access, self.events = deps.reader, deps.access, deps.events
        self.writer = writer
        self.applier = Applier(deps.reader, writer, field_manager=FIELD_MANAGER)

    async def reconcile(self, request: Request) -> Result:
        obj = self.reader.get(SERVICE, request.name, request.namespace or None)
        if obj is None:
            return Result()
        if lb.tailnet_of(obj) is None or obj["metadata"].get("deletionTimestamp"):
            return await self.release(obj)
        try:
            return await self.pipeline.reconcile(request)
        except Forbidden as exc:
            return await self.not_granted(obj, exc)

    async def not_granted(self, obj: JSON, exc: Forbidden) -> Result:
        """The finalizer could not be held: the operator may patch a Service only in a namespace that
        granted it the tenant role (never cluster-wide: that would let it rewrite any Service). Say
        so in the status (which it may write anywhere), after the tenancy, which needs no write."""
        try:
            run = self.phases.parse(obj, self.node.tailnet_name)
            refusal = self.node.refusal(run, None)
            stop = NotReady.refused(refusal) if refusal is not None else NotReady(
                "False", "NamespaceNotGranted", self.node.not_granted(run, exc))
        except NotReady as found:
            stop = found
        return await self.phases.stop(obj, stop)

    async def release(self, obj: JSON) -> Result:
        """Undo what serving the Service made; a Service the operator never wrote to is not written to."""
        location = self.node.key_location(obj)
        record = self.reader.get(SECRET, *location)
        held = record is not None or finalizer.holds(obj)
        if not held and not _wrote_status(obj):
            return Result()
        staying = not obj["metadata"].get("deletionTimestamp")
        if staying:
            await self._delete_agent(obj)
        if (stored := AuthKey.from_secret(record)) is not None:
            again = await self.phases.cleanup.run(obj, lambda: self._expire(obj, record, stored),
                                                  what=f"pre-auth key {stored.prefix}",
                                                  reason="PreAuthKeyNotExpired", hint=SKIP_HINT)
            if again is not None:
                return again
        if record is not None:
            with contextlib.suppress(NotFound):
                await self.writer.delete(SECRET, *location)
        if staying:
            await self._forget_status(obj)
        if staying and held:
            await self.events.normal(obj, "LoadBalancerReleased", (
                "the Service no longer has a tailnet loadBalancerClass: what the operator made for it is gone (its "
                "pre-auth key expired, its agent's objects deleted, its status cleared)"), action="Release")
        if finalizer.holds(obj):
            await finalizer.release(self.writer, SERVICE, obj)
        return Result()

    async def _delete_agent(self, obj: JSON) -> None:
        """Delete what the Service owns (garbage collection would not: the Service stays). The kinds
        the cache lists everywhere are pruned; the Secret and ConfigMap, which it reads only by name
        outside the operator's namespaces, are found by their names."""
        namespace, uid = obj["metadata"]["namespace"], str(obj["metadata"]["uid"])
        await self.applier.apply(obj, Desired.of(prune=[(k, namespace) for k in LISTED_KINDS]))
        for resource, name in _named_objects(obj):
            found = self.reader.get(resource, name, namespace)
            if found is not None and owned_by(found, uid):
                with contextlib.suppress(NotFound):
                    await self.writer.delete(resource, name, namespace, uid=found["metadata"].get("uid"))

    async def _expire(self, obj: JSON, record: JSON | None, stored: AuthKey) -> None:
        """Expire the key on the Tailnet the record names (or the class, when it has no label)."""
        name = ((record or {}).get("metadata", {}).get("labels") or {}).get(TAILNET_LABEL) or lb.tailnet_of(obj)
        tailnet = self.reader.get(Tailnet, name or "")
        if tailnet is None:
            raise NoAccess(f"the Tailnet {name} is gone")
        async with self.access.open(self.access.working(tailnet)) as hs:
            await self.phases.keys.expire(hs, stored)
        await self.events.normal(obj, "PreAuthKeyExpired", f"expired pre-auth key {stored.prefix}", action="Expire")

    async def _forget_status(self, obj: JSON) -> None:
        """Remove what this controller wrote to the status (an apply that sends none of it)."""
        meta = obj["metadata"]
        await self.writer.apply_status(SERVICE, {"metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                                                 "status": {}}, field_manager=FIELD_MANAGER)
