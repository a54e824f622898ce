"""The Egress reconciler: one TailnetEgress (operator namespace only) becomes a tailnet node.

Per CR, in this order, so nothing reaches the tailnet unless the policy owns the tag:

1. tag pre-check against the live policy: a tag the policy does not own is Ready=False
   ``TagNotOwned`` with a paste-ready snippet, and nothing is created on the tailnet;
2. the pre-auth key (:mod:`.preauth`), rotated at half-life and on URL or tag change;
3. the agent's ConfigMap (targets, CA), Deployment, one Service per target, the agent's status
   Service and a NetworkPolicy, all server-side applied and owned by the CR; Services of removed
   targets are deleted;
4. status: ``node`` and every target's route state from the agent's ``/status`` refined with
   Headscale (:mod:`.egress_status`), and the conditions.

A TailnetEgress in any other namespace is never acted on (the Policy reconciler reports it).
Deleting a CR expires its key (finalizer); garbage collection removes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import structlog

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node
from tailnet_operator.policy import PolicyParseError
from tailnet_operator.resources import egress as build
from tailnet_operator.runtime import (
    CONFIG_MAP,
    FINALIZER,
    SECRET,
    SERVICE,
    Request,
    Resource,
    Result,
    Writer,
    add_finalizer,
    has_finalizer,
    remove_finalizer,
)
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.types import JSON

from .access import Deps, NoAccess, Problem
from .conditions import Cond, Status
from .dns import in_zone
from .egress_status import AgentStatusReader, HttpAgentStatus, TargetState, classify
from .kinds import TAILNET_EGRESS
from .preauth import AuthKey, AuthKeyKeeper, Wanted, auth_key_secret_name
from .shared import parsed_with_tailnet, still_trying, tag_gap, tag_not_owned_message, working_connection
from .status import StatusWriter

__all__ = ["FIELD_MANAGER", "EgressReconciler", "EgressSettings"]

log = structlog.get_logger("controllers.egress")

FIELD_MANAGER = "tailnet-operator-egress"
RESYNC_SECONDS = 30.0
"""Routes and the agent's view change on their own; status is refreshed this often."""
RETRY_SECONDS = 10.0
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "TargetsReady", "AliasesServed")


@dataclass(frozen=True)
class EgressSettings:
    """What the operator decides for every agent: its image and who may read its /status."""

    agent_image: str
    operator_labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """One reconcile of one TailnetEgress."""

    obj: JSON
    egress: TailnetEgress
    tailnet: Tailnet

    @property
    def name(self) -> str:
        return str(self.egress.metadata.name)

    @property
    def name_of_tailnet(self) -> str:
        return str(self.tailnet.metadata.name)


class EgressReconciler:
    """Reconciles one TailnetEgress; writes as :data:`FIELD_MANAGER` through ``writer``."""

    def __init__(self, deps: Deps, writer: Writer, settings: EgressSettings, *,
                 agent_status: AgentStatusReader | None = None) -> None:
        self.reader, self.access, self.events, self.clock = deps.reader, deps.access, deps.events, deps.clock
        self.writer = writer
        self.settings = settings
        self.agent_status = agent_status or HttpAgentStatus()
        self.status = StatusWriter(writer, deps.clock, field_manager=FIELD_MANAGER)
        self.keys = AuthKeyKeeper(writer, deps.clock, field_manager=FIELD_MANAGER)

    @property
    def namespace(self) -> str:
        return self.access.namespace

    async def reconcile(self, request: Request) -> Result:
        if request.namespace != self.namespace:
            return Result()  # never acted on; the Policy reconciler logs and records it once
        obj = self.reader.get(TAILNET_EGRESS, request.name, request.namespace)
        if obj is None:
            return Result()
        if obj["metadata"].get("deletionTimestamp"):
            return await self._finalize(obj)
        found = await parsed_with_tailnet(self.reader, obj, TailnetEgress, self._not_ready)
        if isinstance(found, Result):
            return found
        egress, tailnet = found
        if not has_finalizer(obj, FINALIZER):
            await add_finalizer(self.writer, TAILNET_EGRESS, obj, FINALIZER)
        return await self._reconcile(Run(obj, egress, tailnet))

    async def _reconcile(self, run: Run) -> Result:
        connection = await working_connection(self.access, run.obj, run.tailnet, self._not_ready)
        if isinstance(connection, Result):
            return connection
        try:
            async with self.access.open(connection) as hs:
                live, _ = await hs.get_policy()
                if snippet := self._tag_gap(run, live):
                    await self._tag_not_owned(run, snippet)
                    return Result(requeue_after=RESYNC_SECONDS)
                key = await self._ensure_key(run, hs)
                nodes = await hs.list_nodes()
        except (HeadscaleError, PolicyParseError) as exc:
            await self._not_ready(run.obj, "Unknown", "HeadscaleUnavailable", f"Headscale: {exc}")
            return Result(requeue_after=RETRY_SECONDS)
        taken = await self._apply(run, key)
        await self._report(run, key, live, nodes, taken)
        return Result(requeue_after=min(RESYNC_SECONDS, max(1.0, self._until(key.rotation_due))))

    def _until(self, moment: datetime) -> float:
        return (moment - self.clock.utcnow()).total_seconds()

    # -- tag and key ----------------------------------------------------------------------------

    def _tag_gap(self, run: Run, live: str) -> str:
        """The snippet that would make the live policy own the tag ("" when it does)."""
        return tag_gap(live, run.egress.spec.tag, egresses=[run.egress])

    async def _tag_not_owned(self, run: Run, snippet: str) -> None:
        message = tag_not_owned_message(run.egress.spec.tag, snippet)
        await self.status.write(TAILNET_EGRESS, run.obj, [
            Cond("Ready", "False", "TagNotOwned", message), Cond("TagOwned", "False", "TagNotOwned", message)],
            keep=CONDITION_TYPES)

    def _secret_metadata(self, run: Run) -> JSON:
        return build.owned_metadata(run.obj, run.egress, auth_key_secret_name(run.name))

    async def _ensure_key(self, run: Run, hs: HeadscaleClient) -> AuthKey:
        secret = self.reader.get(SECRET, auth_key_secret_name(run.name), self.namespace)
        wanted = Wanted(login_url=str(run.tailnet.spec.login_url), tag=run.egress.spec.tag)
        key, reason = await self.keys.ensure(hs, self._secret_metadata(run), AuthKey.from_secret(secret), wanted)
        if reason:
            await self.events.normal(run.obj, "PreAuthKeyRotated",
                                     f"new pre-auth key {key.prefix} ({reason})", action="Rotate")
        return key

    # -- objects --------------------------------------------------------------------------------

    def _agent(self, run: Run, key: AuthKey) -> build.AgentSpec:
        try:
            ca = self.access.endpoint(run.tailnet).ca
        except Problem:
            ca = None
        return build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                               auth_secret=auth_key_secret_name(run.name), ca_bundle=ca,
                               operator_labels=self.settings.operator_labels)

    async def _apply(self, run: Run, key: AuthKey) -> dict[str, str]:
        """Apply every object; returns the targets whose Service name is taken (name: holder)."""
        agent = self._agent(run, key)
        current = self.reader.get(CONFIG_MAP, build.config_map_name(run.egress), self.namespace)
        ports = build.listen_ports(run.egress, build.previous_listen_ports(current))
        await self._put(CONFIG_MAP, build.config_map(run.obj, run.egress, ports, agent.ca_bundle))
        await self._put(DEPLOYMENT, build.deployment(run.obj, run.egress, agent))
        await self._put(SERVICE, build.agent_service(run.obj, run.egress))
        taken: dict[str, str] = {}
        for name in build.target_names(run.egress):
            if holder := self._service_holder(run, name):
                taken[name] = holder
                continue
            await self._put(SERVICE, build.target_service(run.obj, run.egress, name, ports))
        await self._put(NETWORK_POLICY, build.network_policy(run.obj, run.egress, ports, agent))
        await self._remove_stale_services(run)
        return taken

    def _service_holder(self, run: Run, name: str) -> str:
        """Who holds the Service a target needs when it is not this CR ("" when free or ours).

        Target names share the operator namespace: the first egress to create ``<name>`` keeps
        it, and a later one is told, rather than the two taking the Service from each other."""
        svc = self.reader.get(SERVICE, name, self.namespace)
        if svc is None:
            return ""
        refs = svc["metadata"].get("ownerReferences") or []
        if any(ref.get("uid") == run.obj["metadata"]["uid"] for ref in refs):
            return ""
        owner = next((ref for ref in refs if ref.get("controller")), None)
        return f"{owner['kind']} {owner['name']}" if owner else "a Service this operator does not manage"

    async def _put(self, resource: Resource, body: JSON) -> None:
        await self.writer.apply(resource, body, field_manager=FIELD_MANAGER)

    async def _remove_stale_services(self, run: Run) -> None:
        """Services of targets no longer in the spec (owned by this CR) are deleted."""
        wanted = {*build.target_names(run.egress), build.agent_name(run.egress)}
        uid = run.obj["metadata"]["uid"]
        for svc in self.reader.list(SERVICE, self.namespace):
            meta = svc["metadata"]
            owned = any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])
            if owned and meta["name"] not in wanted:
                await self.writer.delete(SERVICE, meta["name"], self.namespace, uid=meta.get("uid"))
                log.info("deleted the Service of a removed target", egress=run.name, service=meta["name"])

    # -- status ---------------------------------------------------------------------------------

    async def _report(self, run: Run, key: AuthKey, live: str, nodes: list[Node], taken: dict[str, str]) -> None:
        agent = await self.agent_status.read(run.egress)
        states = [_conflict(run.egress, t.name, taken[t.name]) if t.name in taken
                  else classify(run.egress, t, agent=agent, nodes=nodes, live_policy=live)
                  for t in run.egress.spec.targets]
        fields: JSON = {"preAuthKey": key.status(), "targets": [s.status() for s in states]}
        if node := _node_status(agent):
            fields["node"] = node
        owned = f"the live policy owns {run.egress.spec.tag}"
        conds = [Cond("TagOwned", "True", "TagOwned", owned),
                 Cond("PreAuthKeyValid", "True", "KeyValid", f"pre-auth key {key.prefix} valid until "
                      f"{key.expires_at.isoformat()}"),
                 *_target_conditions(states)]
        if aliases := _aliases_condition(run):
            conds.append(aliases)
        await self.status.write(TAILNET_EGRESS, run.obj, conds, fields)

    async def _not_ready(self, obj: JSON, status: Status, reason: str, message: str) -> None:
        await self.status.write(TAILNET_EGRESS, obj, [Cond("Ready", status, reason, message)], keep=CONDITION_TYPES)

    # -- deletion -------------------------------------------------------------------------------

    async def _finalize(self, obj: JSON) -> Result:
        if not has_finalizer(obj, FINALIZER):
            return Result()
        name = obj["metadata"]["name"]
        stored = AuthKey.from_secret(self.reader.get(SECRET, auth_key_secret_name(name), self.namespace))
        if stored is not None:
            try:
                await self._expire(obj, stored)
            except (HeadscaleError, NoAccess, Problem) as exc:
                if still_trying(obj, self.clock):
                    log.info("cannot expire the pre-auth key yet", egress=name, error=str(exc))
                    return Result(requeue_after=RETRY_SECONDS)
                await self.events.warning(obj, "PreAuthKeyNotExpired",
                                          f"could not expire pre-auth key {stored.prefix}: {exc}; expire it by "
                                          "hand (headscale preauthkeys expire)", action="Expire")
        await remove_finalizer(self.writer, TAILNET_EGRESS, obj, FINALIZER)
        return Result()

    async def _expire(self, obj: JSON, stored: AuthKey) -> None:
        tailnet = self.reader.get(Tailnet, (obj.get("spec") or {}).get("tailnetRef", {}).get("name", ""))
        if tailnet is None:
            raise NoAccess("the Tailnet is gone")
        async with self.access.open(self.access.working(tailnet)) as hs:
            await self.keys.expire(hs, stored)
        await self.events.normal(obj, "PreAuthKeyExpired", f"expired pre-auth key {stored.prefix}",
                                 action="Expire")


def _node_status(agent: JSON | None) -> JSON | None:
    node = (agent or {}).get("node")
    if not isinstance(node, dict) or not node.get("id"):
        return None
    return {"id": str(node["id"]), "name": str(node.get("name") or ""),
            "addresses": [str(a) for a in node.get("addresses") or []]}


def _aliases_condition(run: Run) -> Cond | None:
    """AliasesServed: every alias lies in one of the Tailnet's DNS zones (None without aliases).

    The hosts file only answers inside ``spec.dns.zones`` (that is what the cluster's DNS forwards
    to it), so the DNS reconciler leaves other aliases out and this says which and why."""
    aliases = [str(a).lower().rstrip(".") for t in run.egress.spec.targets for a in t.aliases or []]
    if not aliases:
        return None
    dns = run.tailnet.spec.dns
    if dns is None:
        return Cond("AliasesServed", "False", "NoHostsFile",
                    f"the Tailnet {run.name_of_tailnet} has no spec.dns, so no alias resolves: "
                    f"{', '.join(aliases)}; add spec.dns (hostsConfigMap and zones) to the Tailnet")
    outside = [a for a in aliases if not any(in_zone(a, str(z)) for z in dns.zones)]
    if outside:
        zones = ", ".join(str(z) for z in dns.zones)
        return Cond("AliasesServed", "False", "OutsideZones",
                    f"not under the Tailnet's DNS zones ({zones}), so not in the hosts file: {', '.join(outside)}; "
                    "rename the alias or add its zone to the Tailnet's spec.dns.zones")
    return Cond("AliasesServed", "True", "InZones", f"{len(aliases)} alias(es) in the hosts file's zones")


def _conflict(egress: TailnetEgress, name: str, holder: str) -> TargetState:
    service = f"{name}.{egress.metadata.namespace}.svc"
    return TargetState(name, service, "Conflict",
                       f"the Service {service} already belongs to {holder}; rename this target (target names "
                       "are Service names, shared by every egress in the operator's namespace)")


def _target_conditions(states: list[TargetState]) -> list[Cond]:
    bad = [s for s in states if s.route != "Ready"]
    if not bad:
        message = f"all {len(states)} target(s) are routed"
        return [Cond("TargetsReady", "True", "Routed", message), Cond("Ready", "True", "Ready", message)]
    first = bad[0]
    message = "; ".join(f"{s.name}: {s.route}: {s.message}" for s in bad)
    status: Status = "Unknown" if all(s.route == "Unknown" for s in bad) else "False"
    reason = "AgentStatusUnknown" if status == "Unknown" else first.route
    return [Cond("TargetsReady", status, reason, message), Cond("Ready", status, reason, message)]
