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
* **Deletion** follows ``deletionPolicy`` (:mod:`.gateway_deletion`).

The reconcile is a state machine over these (:meth:`GatewayReconciler.state`), built from the
tagged-node phases of :mod:`.pipeline` (parse, connection, tag check, key), its objects applied by
:mod:`.gateway_objects` and its status built by :mod:`.gateway_status`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import structlog

from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.resources import gateway as build
from tailnet_operator.runtime import SECRET, NotFound, Request, Result, Writer
from tailnet_operator.runtime.kinds import POD
from tailnet_operator.types import JSON

from . import periods
from .access import Deps
from .conditions import Cond, rfc3339
from .gateway_deletion import GatewayDeletion
from .gateway_objects import RouterObjects
from .gateway_status import (
    CONDITION_TYPES,
    Placed,
    image_ignored,
    node_conditions,
    restart_condition,
    routes_condition,
    split_dns_condition,
    status_fields,
)
from .kinds import TAILNET_GATEWAY
from .pipeline import NotReady, Phases, Run

__all__ = ["FIELD_MANAGER", "RECEIPTS_FIELD_MANAGER", "GatewayReconciler", "GatewaySettings"]

log = structlog.get_logger("controllers.gateway")

FIELD_MANAGER = "tailnet-operator-gateway"
RECEIPTS_FIELD_MANAGER = "tailnet-operator-gateway-receipts"
"""Receipts are applied once by their own manager, so no later status write can drop them."""

State = Literal["Suspended", "Creating", "Created"]


@dataclass(frozen=True)
class GatewaySettings:
    """Where routers run, the gateway namespace (Pod Security ``privileged``, the chart makes it),
    and what they run: ``router_image`` (tailscaled, its CLI and a shell) and, when the nodes'
    kubelets allow those sysctls, IP forwarding set on the pod (``router_sysctls``)."""

    namespace: str = "tailnet-gateway"
    router_image: str = build.DEFAULT_ROUTER_IMAGE
    router_sysctls: bool = False


class GatewayReconciler:
    """Reconciles one TailnetGateway; writes as :data:`FIELD_MANAGER` through ``writer``.

    The finalizer is held only once the tag pre-check passed (nothing exists before)."""

    def __init__(self, deps: Deps, writer: Writer, settings: GatewaySettings) -> None:
        self.settings = settings
        self.phases: Phases[TailnetGateway] = Phases(deps, writer, TAILNET_GATEWAY, TailnetGateway,
                                                     field_manager=FIELD_MANAGER, condition_types=CONDITION_TYPES)
        self.objects = RouterObjects(deps.reader, writer, deps.access, field_manager=FIELD_MANAGER)
        self.deletion = GatewayDeletion(self.phases, settings.namespace)
        self.reader, self.writer, self.events, self.clock = deps.reader, writer, deps.events, deps.clock

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    async def reconcile(self, request: Request) -> Result:
        if (obj := self.phases.load(request)) is None:
            return Result()
        if obj["metadata"].get("deletionTimestamp"):
            return await self.deletion.finalize(obj)
        try:
            run = self.phases.parse(obj, lambda cr: cr.spec.tailnet_ref.name)
            state = self.state(run)
            if state == "Suspended":
                raise NotReady("False", "Suspended", self._suspended_message(run), requeue_after=None)
            async with self.phases.headscale(self.phases.connection(run.tailnet)) as hs:
                nodes = await hs.list_nodes()
                if state == "Created":
                    return await self._follow(run, hs, nodes)
                return await self._create(run, hs, nodes)
        except NotReady as stop:
            return await self.phases.stop(obj, stop)

    def state(self, run: Run[TailnetGateway]) -> State:
        """Suspended (nothing more is done), Creating (until the receipts are written), Created."""
        if run.cr.spec.suspend:
            return "Suspended"
        return "Created" if run.cr.status and run.cr.status.receipts else "Creating"

    def _suspended_message(self, run: Run[TailnetGateway]) -> str:
        created = (run.cr.status is not None and run.cr.status.receipts is not None) or self._own_state(run) is not None
        if created:
            return ("spec.suspend is true: the router keeps running as it is, but changes to the spec, the "
                    "routes and the hosts file are not followed until it is false again")
        return ("spec.suspend is true: nothing is created; set it to false to create the router "
                "(once: its identity is then pinned in receipts)")

    def _state_secret(self, run: Run[TailnetGateway]) -> JSON | None:
        return self.reader.get(SECRET, build.state_secret_name(run.cr), self.namespace)

    def _own_state(self, run: Run[TailnetGateway]) -> JSON | None:
        """The state Secret if this very object created it (its uid is on it), else None."""
        state = self._state_secret(run)
        notes = ((state or {}).get("metadata") or {}).get("annotations") or {}
        return state if state is not None and notes.get(build.OWNER_UID_ANNOTATION) == run.uid else None

    def _router(self, run: Run[TailnetGateway]) -> build.Router:
        return build.Router(namespace=self.namespace, tailnet=str(run.tailnet.metadata.name),
                            control_url=str(run.tailnet.spec.login_url), image=self.settings.router_image,
                            forwarding_sysctls=self.settings.router_sysctls)

    # -- Creating: exactly once -----------------------------------------------------------------

    async def _create(self, run: Run[TailnetGateway], hs: HeadscaleClient, nodes: list[Node]) -> Result:
        state = self._state_secret(run)
        if state is not None and self._own_state(run) is None:
            raise _not_registered("StateSecretExists", (
                f"the state Secret {self.namespace}/{build.state_secret_name(run.cr)} exists, but this "
                "TailnetGateway has no receipts and did not create it; it is not adopted and nothing was created. "
                "If it belongs to a router you still run, keep it and give this TailnetGateway another name; if "
                "it is left over, delete the Secret and the operator creates a fresh router"))
        live, _ = await hs.get_policy()
        tag = run.cr.spec.tag
        self.phases.check_tag(live, derive_from_objects(gateways=[run.cr]), tag)
        await self.phases.hold_finalizer(run.obj)
        if state is None:
            state = await self._put_state(run)
            await self.events.normal(run.obj, "Creating",
                                     f"created the state Secret {self.namespace}/{build.state_secret_name(run.cr)}"
                                     " and the router, once", action="Create")
        location = (build.auth_key_secret(run.cr), self.namespace)
        key = await self.phases.ensure_key(hs, run.obj, location, build.auth_key_metadata(run.cr, self.namespace),
                                           run.tailnet, tag, single_use=True)
        ids = build.key_ids(state) | {key.id, key.previous_id} - {""}
        if ids != build.key_ids(state):
            await self._put_state(run, ids)
        placed = await self.objects.apply(run.cr, run.tailnet, self._router(run))
        node = next((n for n in nodes if n.pre_auth_key_id in ids), None)
        if node is None:
            what = ("waiting for the CoreDNS Service's address before creating the router" if not placed.router
                    else f"waiting for the router pod {self.namespace}/{build.pod_name(run.cr)} to register "
                         f"with pre-auth key {key.prefix}")
            await self._write(run, [Cond("Ready", "False", "Registering", what),
                                    Cond("Registered", "False", "Registering", what), self.phases.tag_owned(tag)],
                              status_fields(run.cr, None, placed))
            return Result(requeue_after=periods.GATEWAY_REGISTER_WAIT)
        await self._write_receipts(run, node)
        with contextlib.suppress(HeadscaleError):
            await self.phases.keys.expire(hs, key)  # one node per gateway: nothing else may register with it
        with contextlib.suppress(NotFound):
            await self.writer.delete(SECRET, *location)
        await self.events.normal(run.obj, "Registered",
                                 f"router node {node.id} ({node.name}) registered; receipts written", action="Register")
        return await self._report(run, node, placed)

    async def _put_state(self, run: Run[TailnetGateway], key_ids: set[str] | None = None) -> JSON:
        body = build.state_secret(run.cr, self.namespace, run.uid, key_ids or ())
        return await self.writer.apply(SECRET, body, field_manager=FIELD_MANAGER)

    async def _write_receipts(self, run: Run[TailnetGateway], node: Node) -> None:
        created = node.created_at or self.clock.utcnow()
        receipts = {"nodeId": node.id, "nodeKey": node.node_key, "createdAt": rfc3339(created),
                    "stateSecret": build.state_secret_name(run.cr)}
        await self.writer.apply_status(TAILNET_GATEWAY, {"metadata": {"name": run.name},
                                                         "status": {"receipts": receipts}},
                                       field_manager=RECEIPTS_FIELD_MANAGER)

    # -- Created: follow the template and the zone, nothing else ---------------------------------

    async def _follow(self, run: Run[TailnetGateway], hs: HeadscaleClient, nodes: list[Node]) -> Result:
        receipts = run.cr.status.receipts if run.cr.status else None
        assert receipts is not None
        node = next((n for n in nodes if n.id == receipts.node_id), None)
        if node is None:
            raise _not_registered("NodeGone", (
                f"the router node {receipts.node_id} is gone from Headscale; the gateway never registers a new "
                "node on its own. For a new router, set deletionPolicy: Delete and delete this TailnetGateway "
                "(its pod and state Secret go too), then create it again"))
        if self._state_secret(run) is None:
            ref = f"{self.namespace}/{receipts.state_secret or build.state_secret_name(run.cr)}"
            raise _not_registered("StateSecretGone", (
                f"the state Secret {ref} is gone; the router cannot come back as node {receipts.node_id} after a "
                "restart and nothing is recreated. Restore the Secret from a backup, or set deletionPolicy: "
                "Delete, delete this TailnetGateway and create it again"))
        placed = await self.objects.apply(run.cr, run.tailnet, self._router(run))
        route = build.host_route(placed.dns_address)  # the CoreDNS /32: the gateway's own route
        if route and route in node.available_routes and route not in node.approved_routes:
            node = await hs.add_approved_routes(node, [route])
        return await self._report(run, node, placed)

    # -- status ---------------------------------------------------------------------------------

    async def _report(self, run: Run[TailnetGateway], node: Node, placed: Placed) -> Result:
        """Write the status; look again soon while routes wait for advertisement or approval."""
        pod = self.reader.get(POD, build.pod_name(run.cr), self.namespace)
        restart, routes = restart_condition(pod, self.namespace, run.cr, placed), routes_condition(placed, node)
        conds = [*node_conditions(node, f"{self.namespace}/{build.pod_name(run.cr)}"), restart, routes,
                 self.phases.tag_owned(run.cr.spec.tag)]
        if split := split_dns_condition(run.cr, placed):
            conds.append(split)
        await self._write(run, conds, status_fields(run.cr, node, placed))
        settling = routes.status != "True" and restart.status != "True"  # a pending restart waits for a person
        return Result(requeue_after=periods.GATEWAY_SETTLING if settling else periods.AGENT_RESYNC)

    async def _write(self, run: Run[TailnetGateway], conds: list[Cond], fields: JSON) -> None:
        if ignored := image_ignored(run.cr, self.settings.router_image):
            conds = [*conds, ignored]
        await self.phases.write(run.obj, conds, fields)


def _not_registered(reason: str, message: str) -> NotReady:
    """Ready and Registered False for a person to act on; nothing else is touched."""
    return NotReady("False", reason, message, also=[Cond("Registered", "False", reason, message)])
