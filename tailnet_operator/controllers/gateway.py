"""The Gateway reconciler: a TailnetGateway (cluster-scoped) becomes one kernel-mode subnet router
and, with ``spec.dns``, the CoreDNS that serves the Tailnet's zone, created exactly once.

* **Suspended** (``spec.suspend``, the default): nothing is created; Ready is ``Suspended``.
* **Creation**, once: the tag pre-check against the live policy, a single-use, non-ephemeral
  pre-auth key for ``spec.tag`` (the key keeper of :mod:`.preauth`), the empty state Secret
  (annotated with this object's uid), the ConfigMap, the CoreDNS Deployment and Service, then the
  router's own ServiceAccount and Role (its state Secret alone), its headless Service and
  StatefulSet (:mod:`tailnet_operator.resources.gateway`). When
  Headscale shows the node registered with that key, the receipts (``nodeId``, ``nodeKey``,
  ``createdAt``, ``stateSecret``) are written once, the key is expired and its Secret deleted:
  from then on nothing can register a second node for this gateway.
* **Fresh-only**: a state Secret this object did not create is never adopted, and receipts whose
  node is gone from Headscale (or whose state Secret is gone) are reported, not repaired.
* **Afterwards** it only follows the operator's router image and the routes into the
  StatefulSet's template (``OnDelete``: ``RestartPending`` says when the pod runs an older
  template) and the Tailnet's hosts file into the zone. It never restarts, adopts or deletes the
  pod.
* **The image** is the operator's (:class:`GatewaySettings`), never the TailnetGateway's: the
  router is the one component with ``NET_ADMIN`` and a host device, and whoever may create a
  TailnetGateway must not choose what runs with them. ``spec.image`` is deprecated and ignored;
  while it is set, the condition ``ImageIgnored`` says so.
* **Deletion**: ``deletionPolicy: Delete`` deletes the StatefulSet, the pod, the Secrets, the
  Services, CoreDNS, the router's ServiceAccount and Role and the Headscale node (retrying
  Headscale for five minutes); ``Retain``
  leaves them and says so in an Event. The objects carry labels, not ownerReferences, so the
  garbage collector never removes the router behind the operator's back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import structlog
from pydantic import ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node
from tailnet_operator.headscale import NotFound as HeadscaleNotFound
from tailnet_operator.policy import PolicyParseError
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.resources import gateway as build
from tailnet_operator.runtime import (
    CONFIG_MAP,
    FINALIZER,
    SECRET,
    SERVICE,
    NotFound,
    Resource,
    Result,
    Writer,
    has_finalizer,
    remove_finalizer,
)
from tailnet_operator.runtime.kinds import DEPLOYMENT, POD, STATEFUL_SET
from tailnet_operator.types import JSON

from .access import Deps, Problem
from .agents import RESYNC_SECONDS, RETRY_SECONDS, AgentReconciler
from .conditions import Cond, rfc3339
from .dns import HOSTS_KEY, in_zone, parse_hosts
from .kinds import TAILNET_EGRESS, TAILNET_GATEWAY
from .policy import TAILNET_INDEX
from .preauth import AuthKey

__all__ = ["FIELD_MANAGER", "RECEIPTS_FIELD_MANAGER", "GatewayReconciler", "GatewaySettings"]

log = structlog.get_logger("controllers.gateway")

FIELD_MANAGER = "tailnet-operator-gateway"
RECEIPTS_FIELD_MANAGER = "tailnet-operator-gateway-receipts"
"""Receipts are applied once by their own manager, so no later status write can drop them."""
WAIT_SECONDS = 2.0
SETTLING_SECONDS = 5.0
"""How soon a gateway whose routes are not all advertised and approved looks again: approval comes
from the Policy reconciler or a person, neither of which the gateway watches."""
CONDITION_TYPES = ("ImageIgnored", "Registered", "RestartPending", "RoutesApproved", "SplitDNS", "TagOwned")

SERVICE_ACCOUNT = Resource("", "v1", "serviceaccounts", "ServiceAccount")
ROLE = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDING = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")


@dataclass(frozen=True)
class GatewaySettings:
    """Where routers run, the gateway namespace (Pod Security ``privileged``, the chart makes it),
    and what they run: ``router_image`` (tailscaled, its CLI and a shell) and, when the nodes'
    kubelets allow those sysctls, IP forwarding set on the pod (``router_sysctls``)."""

    namespace: str = "tailnet-gateway"
    router_image: str = build.DEFAULT_ROUTER_IMAGE
    router_sysctls: bool = False


@dataclass(frozen=True)
class Run:
    """One reconcile of one TailnetGateway."""

    obj: JSON
    gateway: TailnetGateway
    tailnet: Tailnet

    @property
    def name(self) -> str:
        return str(self.gateway.metadata.name)

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"]["uid"])


@dataclass(frozen=True)
class Applied:
    """What :meth:`GatewayReconciler._apply` put in place."""

    routes: tuple[str, ...] = ()
    dns_address: str = ""
    template_hash: str = ""
    router: bool = False
    """False while the StatefulSet waits for the CoreDNS Service's address."""


class GatewayReconciler(AgentReconciler):
    """Reconciles one TailnetGateway; writes as :data:`FIELD_MANAGER` through ``writer``.

    The reconcile up to :meth:`reconcile_one` is the agents' (:class:`~.agents.AgentReconciler`);
    the finalizer is held only once the tag pre-check passed (nothing exists before), and
    :meth:`finalize` is the gateway's own (deletionPolicy)."""

    kind = TAILNET_GATEWAY
    model = TailnetGateway
    condition_types = CONDITION_TYPES
    finalizer_first = False

    def __init__(self, deps: Deps, writer: Writer, settings: GatewaySettings) -> None:
        super().__init__(deps, writer, field_manager=FIELD_MANAGER)
        self.settings = settings

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    def key_namespace(self, obj: JSON) -> str | None:
        return self.namespace

    async def reconcile_one(self, obj: JSON, parsed: TailnetGateway, tailnet: Tailnet) -> Result:
        gateway = parsed
        run = Run(obj, gateway, tailnet)
        if gateway.spec.suspend:
            await self._suspended(run)
            return Result()
        connection = await self.working_connection(obj, tailnet)
        if isinstance(connection, Result):
            return connection
        try:
            async with self.access.open(connection) as hs:
                nodes = await hs.list_nodes()
                if gateway.status and gateway.status.receipts:
                    return await self._follow(run, hs, nodes)
                return await self._create(run, hs, nodes)
        except (HeadscaleError, PolicyParseError) as exc:
            await self.not_ready(obj, "Unknown", "HeadscaleUnavailable", f"Headscale: {exc}")
            return Result(requeue_after=RETRY_SECONDS)

    # -- suspended ------------------------------------------------------------------------------

    async def _suspended(self, run: Run) -> None:
        if self._created(run):
            message = ("spec.suspend is true: the router keeps running as it is, but changes to the spec, the "
                       "routes and the hosts file are not followed until it is false again")
        else:
            message = ("spec.suspend is true: nothing is created; set it to false to create the router "
                       "(once: its identity is then pinned in receipts)")
        await self.not_ready(run.obj, "False", "Suspended", message)

    def _created(self, run: Run) -> bool:
        receipts = run.gateway.status.receipts if run.gateway.status else None
        return receipts is not None or self._own_state(run) is not None

    def _state(self, run: Run) -> JSON | None:
        return self.reader.get(SECRET, build.state_secret_name(run.gateway), self.namespace)

    def _own_state(self, run: Run) -> JSON | None:
        """The state Secret if this very object created it (its uid is on it), else None."""
        state = self._state(run)
        notes = ((state or {}).get("metadata") or {}).get("annotations") or {}
        return state if state is not None and notes.get(build.OWNER_UID_ANNOTATION) == run.uid else None

    # -- creation, exactly once -----------------------------------------------------------------

    async def _create(self, run: Run, hs: HeadscaleClient, nodes: list[Node]) -> Result:
        state = self._state(run)
        if state is not None and self._own_state(run) is None:
            return await self._state_not_ours(run)
        live, _ = await hs.get_policy()
        tag = run.gateway.spec.tag
        if snippet := self.tag_gap(live, derive_from_objects(gateways=[run.gateway]), tag):
            await self.tag_not_owned(run.obj, tag, snippet)
            return Result(requeue_after=RESYNC_SECONDS)
        await self.hold_finalizer(run.obj)
        if state is None:
            state = await self._put(SECRET, build.state_secret(run.gateway, self.namespace, run.uid))
            await self.events.normal(run.obj, "Creating",
                                     f"created the state Secret {self.namespace}/{build.state_secret_name(run.gateway)}"
                                     " and the router, once", action="Create")
        key = await self.ensure_key(hs, run.obj, build.auth_key_metadata(run.gateway, self.namespace), run.tailnet,
                                    run.gateway.spec.tag, single_use=True)
        ids = build.key_ids(state) | {key.id, key.previous_id} - {""}
        if ids != build.key_ids(state):
            await self._put(SECRET, build.state_secret(run.gateway, self.namespace, run.uid, ids))
        applied = await self._apply(run)
        node = next((n for n in nodes if n.pre_auth_key_id in ids), None)
        if node is None:
            what = ("waiting for the CoreDNS Service's address before creating the router" if not applied.router
                    else f"waiting for the router pod {self.namespace}/{build.pod_name(run.gateway)} to register "
                         f"with pre-auth key {key.prefix}")
            await self._write(run, [
                Cond("Ready", "False", "Registering", what), Cond("Registered", "False", "Registering", what),
                self.tag_owned(run.gateway.spec.tag)], self._fields(run, None, applied))
            return Result(requeue_after=WAIT_SECONDS)
        await self._write_receipts(run, node)
        with contextlib.suppress(HeadscaleError):
            await self.keys.expire(hs, key)  # one node per gateway: nothing else may register with it
        await self._delete(SECRET, build.auth_key_secret(run.gateway))
        await self.events.normal(run.obj, "Registered",
                                 f"router node {node.id} ({node.name}) registered; receipts written", action="Register")
        return await self._report(run, hs, node, applied)

    async def _state_not_ours(self, run: Run) -> Result:
        ref = f"{self.namespace}/{build.state_secret_name(run.gateway)}"
        message = (f"the state Secret {ref} exists, but this TailnetGateway has no receipts and did not create it; "
                   "it is not adopted and nothing was created. If it belongs to a router you still run, keep it "
                   "and give this TailnetGateway another name; if it is left over, delete the Secret and the "
                   "operator creates a fresh router")
        return await self._not_registered(run, "StateSecretExists", message)

    async def _write_receipts(self, run: Run, node: Node) -> None:
        created = node.created_at or self.clock.utcnow()
        receipts = {"nodeId": node.id, "nodeKey": node.node_key, "createdAt": rfc3339(created),
                    "stateSecret": build.state_secret_name(run.gateway)}
        await self.writer.apply_status(TAILNET_GATEWAY, {"metadata": {"name": run.name},
                                                         "status": {"receipts": receipts}},
                                       field_manager=RECEIPTS_FIELD_MANAGER)

    # -- afterwards: follow the template and the zone, nothing else ------------------------------

    async def _follow(self, run: Run, hs: HeadscaleClient, nodes: list[Node]) -> Result:
        receipts = run.gateway.status.receipts if run.gateway.status else None
        assert receipts is not None
        node = next((n for n in nodes if n.id == receipts.node_id), None)
        if node is None:
            message = (f"the router node {receipts.node_id} is gone from Headscale; the gateway never registers "
                       "a new node on its own. For a new router, set deletionPolicy: Delete and delete this "
                       "TailnetGateway (its pod and state Secret go too), then create it again")
            return await self._not_registered(run, "NodeGone", message)
        if self._state(run) is None:
            ref = f"{self.namespace}/{receipts.state_secret or build.state_secret_name(run.gateway)}"
            message = (f"the state Secret {ref} is gone; the router cannot come back as node {receipts.node_id} "
                       "after a restart and nothing is recreated. Restore the Secret from a backup, or set "
                       "deletionPolicy: Delete, delete this TailnetGateway and create it again")
            return await self._not_registered(run, "StateSecretGone", message)
        applied = await self._apply(run)
        node = await self._approve_dns_route(hs, node, applied.dns_address)
        return await self._report(run, hs, node, applied)

    async def _approve_dns_route(self, hs: HeadscaleClient, node: Node, address: str) -> Node:
        """The CoreDNS /32 is the gateway's own route: approved on its node once advertised."""
        route = build.host_route(address)
        if route and route in node.available_routes and route not in node.approved_routes:
            return await hs.add_approved_routes(node, [route])
        return node

    # -- objects --------------------------------------------------------------------------------

    def _router(self, run: Run) -> build.Router:
        try:
            ca = self.access.endpoint(run.tailnet).ca
        except Problem:
            ca = None
        return build.Router(namespace=self.namespace, tailnet=str(run.tailnet.metadata.name),
                            control_url=str(run.tailnet.spec.login_url), image=self.settings.router_image,
                            ca_bundle=ca, forwarding_sysctls=self.settings.router_sysctls)

    async def _apply(self, run: Run) -> Applied:
        """Apply the ConfigMap, CoreDNS and the router; the StatefulSet waits for CoreDNS's address,
        which is one of its routes (so its template does not change right after creation)."""
        router = self._router(run)
        await self._put(CONFIG_MAP, build.config_map(run.gateway, router, self._zone_entries(run)))
        address = ""
        if run.gateway.spec.dns is not None:
            await self._put(DEPLOYMENT, build.dns_deployment(run.gateway, router))
            service = await self._put(SERVICE, build.dns_service(run.gateway, router))
            address = _cluster_ip(service) or _cluster_ip(
                self.reader.get(SERVICE, build.dns_name(run.gateway), self.namespace))
            if not address:
                return Applied()
        routes = build.advertised_routes(run.gateway, self._egress_addresses(run), address)
        router = replace(router, routes=routes)
        sts = build.stateful_set(run.gateway, router)
        # the pod's identity before the pod: the StatefulSet controller cannot create it without
        await self._put(SERVICE_ACCOUNT, build.router_service_account(run.gateway, self.namespace))
        await self._put(ROLE, build.router_role(run.gateway, self.namespace))
        await self._put(ROLE_BINDING, build.router_role_binding(run.gateway, self.namespace))
        await self._put(SERVICE, build.router_service(run.gateway, router))
        await self._put(STATEFUL_SET, sts)
        return Applied(routes, address, sts["spec"]["template"]["metadata"]["annotations"][
            build.TEMPLATE_HASH_ANNOTATION], router=True)

    def _zone_entries(self, run: Run) -> dict[str, str]:
        """The names of the Tailnet's hosts file that are in the gateway's zone."""
        dns, zone = run.tailnet.spec.dns, run.gateway.spec.dns
        if dns is None or zone is None:
            return {}
        ref = dns.hosts_config_map
        current = self.reader.get(CONFIG_MAP, ref.name, ref.namespace)
        hosts = parse_hosts(str(((current or {}).get("data") or {}).get(HOSTS_KEY, "")))
        return {name: address for name, address in hosts.items() if in_zone(name, zone.zone)}

    def _egress_addresses(self, run: Run) -> list[str]:
        """Target addresses of the operator namespace's egresses of this Tailnet (names are skipped
        by the route builder)."""
        addresses: list[str] = []
        for obj in self.reader.list(TAILNET_EGRESS, self.access.namespace,
                                    index=(TAILNET_INDEX, str(run.tailnet.metadata.name))):
            if obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                egress = TailnetEgress.model_validate(obj)
            except ValidationError:
                continue
            addresses.extend(str(t.address) for t in egress.spec.targets)
        return addresses

    async def _put(self, resource: Resource, body: JSON) -> JSON:
        return await self.writer.apply(resource, body, field_manager=FIELD_MANAGER)

    async def _delete(self, resource: Resource, name: str) -> bool:
        """Delete one object of the gateway namespace; False when it was not there."""
        try:
            await self.writer.delete(resource, name, self.namespace)
        except NotFound:
            return False
        return True

    # -- status ---------------------------------------------------------------------------------

    async def _report(self, run: Run, hs: HeadscaleClient, node: Node, applied: Applied) -> Result:
        """Write the status; look again soon while routes wait for advertisement or approval."""
        registered = Cond("Registered", "True", "Registered",
                          f"router node {node.id} ({node.name}) is in Headscale with the receipts' identity")
        if node.online:
            ready = Cond("Ready", "True", "Running",
                         f"router node {node.id} is online and advertises {len(node.available_routes)} route(s)")
        else:
            pod = f"{self.namespace}/{build.pod_name(run.gateway)}"
            ready = Cond("Ready", "False", "NodeOffline", f"router node {node.id} is offline; see the pod {pod}")
        restart, routes = self._restart_condition(run, applied), _routes_condition(applied, node)
        conds = [ready, registered, restart, routes, self.tag_owned(run.gateway.spec.tag)]
        if split := _split_dns_condition(run, applied):
            conds.append(split)
        await self._write(run, conds, self._fields(run, node, applied))
        settling = routes.status != "True" and restart.status != "True"  # a pending restart waits for a person
        return Result(requeue_after=SETTLING_SECONDS if settling else RESYNC_SECONDS)

    def _restart_condition(self, run: Run, applied: Applied) -> Cond:
        pod = self.reader.get(POD, build.pod_name(run.gateway), self.namespace)
        ref = f"{self.namespace}/{build.pod_name(run.gateway)}"
        if pod is None:
            return Cond("RestartPending", "Unknown", "PodNotFound",
                        f"the pod {ref} does not exist (yet); the StatefulSet creates it from the current template")
        running = ((pod["metadata"].get("annotations") or {}).get(build.TEMPLATE_HASH_ANNOTATION) or "")
        if running == applied.template_hash:
            return Cond("RestartPending", "False", "UpToDate", f"the pod {ref} runs the current template")
        return Cond("RestartPending", "True", "TemplateChanged",
                    f"the router's template changed (its image, routes or settings); the StatefulSet's update "
                    f"strategy is OnDelete, so the pod "
                    f"{ref} keeps the old template until a person deletes it (kubectl delete pod -n "
                    f"{self.namespace} {build.pod_name(run.gateway)}); it comes back as the same node from its "
                    "state Secret. The operator never restarts it")

    def _fields(self, run: Run, node: Node | None, applied: Applied) -> JSON:
        fields: JSON = {}
        if node is not None:
            fields["routes"] = {"advertised": sorted(node.available_routes),
                                "approved": sorted(node.approved_routes)}
        if run.gateway.spec.dns is not None and applied.dns_address:
            fields["dns"] = {"zone": run.gateway.spec.dns.zone, "serverAddress": applied.dns_address}
        return fields

    async def _not_registered(self, run: Run, reason: str, message: str) -> Result:
        """Ready and Registered False for a person to act on; nothing else is touched."""
        await self._write(run, [Cond("Ready", "False", reason, message), Cond("Registered", "False", reason, message)],
                          keep=CONDITION_TYPES)
        return Result(requeue_after=RESYNC_SECONDS)

    async def _write(self, run: Run, conds: list[Cond], fields: JSON | None = None, *,
                     keep: tuple[str, ...] = ()) -> None:
        if ignored := self._image_ignored(run):
            conds = [*conds, ignored]
        await self.status.write(TAILNET_GATEWAY, run.obj, conds, fields, keep=keep)

    def _image_ignored(self, run: Run) -> Cond | None:
        """ImageIgnored while the deprecated ``spec.image`` is set (absent otherwise)."""
        if not run.gateway.spec.image:
            return None
        return Cond("ImageIgnored", "True", "Deprecated",
                    f"spec.image ({run.gateway.spec.image}) is deprecated and ignored: the router runs "
                    f"{self.settings.router_image}, the image the operator is configured with "
                    "(--gateway-router-image, chart value gateway.router.image); remove spec.image")

    # -- deletion -------------------------------------------------------------------------------

    async def finalize(self, obj: JSON) -> Result:
        """deletionPolicy Delete: the objects, the node and an unused key go; Retain: an Event says what stays."""
        if not has_finalizer(obj, FINALIZER):
            return Result()
        name = obj["metadata"]["name"]
        spec = obj.get("spec") or {}
        receipts = (obj.get("status") or {}).get("receipts") or {}
        node_id = str(receipts.get("nodeId") or "")
        pod = f"{self.namespace}/{name}-gateway-0"
        secret = f"{self.namespace}/{name}-gateway-state"
        if spec.get("deletionPolicy", "Retain") != "Delete":
            node = f"Headscale node {node_id}" if node_id else "its Headscale node (if it registered)"
            await self.events.normal(obj, "Retained",
                                     f"deletionPolicy Retain: left the router pod {pod}, its state Secret {secret} "
                                     f"and {node} in place; remove them by hand (kubectl delete statefulset,secret,"
                                     f"service,deployment,configmap,serviceaccount,role,rolebinding -n "
                                     f"{self.namespace} -l tailnet.dev/gateway={name}"
                                     + (f"; headscale nodes delete -i {node_id})" if node_id else ")"),
                                     action="Retain")
            await remove_finalizer(self.writer, TAILNET_GATEWAY, obj, FINALIZER)
            return Result()
        stored = AuthKey.from_secret(self.reader.get(SECRET, self.key_secret_name(name), self.namespace))
        gone = await self._delete_objects(name)
        if node_id or stored is not None:
            again = await self.cleanup.run(
                obj, lambda: self._forget_node(obj, node_id, stored),
                what=f"Headscale node {node_id or '(unknown)'}"
                + (f" and pre-auth key {stored.prefix}" if stored else ""),
                reason="NodeNotDeleted", hint="delete it by hand (headscale nodes delete)")
            if again is not None:
                return again
        await self.events.normal(obj, "Deleted",
                                 f"deletionPolicy Delete: deleted {', '.join(gone) or 'no objects'}"
                                 + (f" and Headscale node {node_id}" if node_id else ""), action="Delete")
        await remove_finalizer(self.writer, TAILNET_GATEWAY, obj, FINALIZER)
        return Result()

    async def _delete_objects(self, name: str) -> list[str]:
        """Delete everything the gateway made in the gateway namespace; names what was there."""
        router, dns = f"{name}-gateway", f"{name}-gateway-dns"
        gone = []
        for resource, what in ((STATEFUL_SET, router), (POD, f"{router}-0"), (DEPLOYMENT, dns), (SERVICE, dns),
                               (SERVICE, router), (CONFIG_MAP, router), (SECRET, f"{router}-state"),
                               (SECRET, self.key_secret_name(name)), (ROLE_BINDING, router), (ROLE, router),
                               (SERVICE_ACCOUNT, router)):
            if await self._delete(resource, what):
                gone.append(f"{resource.kind} {what}")
        return gone

    async def _forget_node(self, obj: JSON, node_id: str, stored: AuthKey | None) -> None:
        """Delete the receipts' node and expire a pre-auth key not used yet."""
        if not node_id and stored is None:
            return
        async with self.access.open(self.tailnet_connection(obj)) as hs:
            if stored is not None:
                await self.keys.expire(hs, stored)
            if node_id:
                with contextlib.suppress(HeadscaleNotFound):
                    await hs.delete_node(node_id)


def _cluster_ip(service: JSON | None) -> str:
    ip = str(((service or {}).get("spec") or {}).get("clusterIP") or "")
    return "" if ip in ("", "None") else ip


def _routes_condition(applied: Applied, node: Node) -> Cond:
    """RoutesApproved: every route the template advertises is advertised by the node and approved."""
    not_advertised = [r for r in applied.routes if r not in node.available_routes]
    not_approved = [r for r in applied.routes if r in node.available_routes and r not in node.approved_routes]
    if not_approved:
        return Cond("RoutesApproved", "False", "NotApproved",
                    f"advertised but approved nowhere: {', '.join(not_approved)}; the policy's autoApprovers "
                    "(see the Tailnet's PolicyApplied) or `headscale nodes approve-routes` approve them")
    if not_advertised:
        return Cond("RoutesApproved", "False", "NotAdvertised",
                    f"in the template but not advertised by the node yet: {', '.join(not_advertised)} "
                    "(a pending restart, see RestartPending)")
    return Cond("RoutesApproved", "True", "Approved", f"all {len(applied.routes)} route(s) advertised and approved")


def _split_dns_condition(run: Run, applied: Applied) -> Cond | None:
    """SplitDNS: what Headscale's configuration must say for tailnet clients to ask this CoreDNS.

    Headscale's DNS settings live in its configuration file, which neither its API nor the operator
    can read or write; so this names the entry to add, as the policy report names what is missing."""
    dns = run.gateway.spec.dns
    if dns is None:
        return None
    if not applied.dns_address:
        return Cond("SplitDNS", "Unknown", "WaitingForAddress", "the CoreDNS Service has no address yet")
    zone = dns.zone.lower().rstrip(".")
    return Cond("SplitDNS", "Unknown", "HeadscaleConfigRequired",
                f"the operator cannot read or write Headscale's configuration file; for tailnet clients to "
                f"resolve {zone} through this gateway, it must contain:\n"
                f"dns:\n  nameservers:\n    split:\n      {zone}:\n        - {applied.dns_address}\n"
                f"and the route {applied.dns_address}/32 must stay approved on the router (the operator approves "
                "it). `tailscale dns status` on a client shows the split route once Headscale serves it")
