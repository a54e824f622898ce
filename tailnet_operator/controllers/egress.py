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

import structlog

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleError, Node
from tailnet_operator.policy import PolicyParseError
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.resources import egress as build
from tailnet_operator.runtime import (
    CONFIG_MAP,
    SERVICE,
    Request,
    Resource,
    Result,
    Writer,
)
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.types import JSON

from .access import Deps, Problem
from .agents import RESYNC_SECONDS, RETRY_SECONDS, AgentReconciler, node_status
from .conditions import Cond, Status
from .dns import in_zone
from .egress_status import AgentStatusReader, HttpAgentStatus, TargetState, classify
from .kinds import TAILNET_EGRESS
from .preauth import AuthKey

__all__ = ["FIELD_MANAGER", "EgressReconciler", "EgressSettings"]

log = structlog.get_logger("controllers.egress")

FIELD_MANAGER = "tailnet-operator-egress"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "TargetsReady", "AliasesServed")


@dataclass(frozen=True)
class EgressSettings:
    """What the operator decides for every agent: its image and who may read its /status."""

    agent_image: str
    operator_labels: dict[str, str] = field(default_factory=dict)
    metrics_namespaces: dict[str, str] = field(default_factory=dict)
    """Namespaces (by labels) admitted to the agents' /metrics: where Prometheus runs."""


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


class EgressReconciler(AgentReconciler):
    """Reconciles one TailnetEgress; writes as :data:`FIELD_MANAGER` through ``writer``."""

    kind = TAILNET_EGRESS
    model = TailnetEgress
    condition_types = CONDITION_TYPES

    def __init__(self, deps: Deps, writer: Writer, settings: EgressSettings, *,
                 agent_status: AgentStatusReader | None = None) -> None:
        super().__init__(deps, writer, field_manager=FIELD_MANAGER)
        self.settings = settings
        self.agent_status = agent_status or HttpAgentStatus()

    @property
    def namespace(self) -> str:
        return self.access.namespace

    def accepts(self, request: Request) -> bool:
        return request.namespace == self.namespace  # elsewhere: the Policy reconciler records it once

    async def reconcile_one(self, obj: JSON, parsed: TailnetEgress, tailnet: Tailnet) -> Result:
        return await self._reconcile(Run(obj, parsed, tailnet))

    async def _reconcile(self, run: Run) -> Result:
        connection = await self.working_connection(run.obj, run.tailnet)
        if isinstance(connection, Result):
            return connection
        try:
            async with self.access.open(connection) as hs:
                live, _ = await hs.get_policy()
                if snippet := self.tag_gap(live, derive_from_objects(egresses=[run.egress]), run.egress.spec.tag):
                    await self.tag_not_owned(run.obj, run.egress.spec.tag, snippet)
                    return Result(requeue_after=RESYNC_SECONDS)
                key = await self.ensure_key(hs, run.obj, self._secret_metadata(run), run.tailnet,
                                            run.egress.spec.tag)
                nodes = await hs.list_nodes()
        except (HeadscaleError, PolicyParseError) as exc:
            await self.not_ready(run.obj, "Unknown", "HeadscaleUnavailable", f"Headscale: {exc}")
            return Result(requeue_after=RETRY_SECONDS)
        taken = await self._apply(run, key)
        await self._report(run, key, live, nodes, taken)
        return Result(requeue_after=min(RESYNC_SECONDS, max(1.0, self.until(key.rotation_due))))

    # -- tag and key ----------------------------------------------------------------------------

    def _secret_metadata(self, run: Run) -> JSON:
        return build.owned_metadata(run.obj, run.egress, self.key_secret_name(run.name))

    # -- objects --------------------------------------------------------------------------------

    def _agent(self, run: Run, key: AuthKey) -> build.AgentSpec:
        try:
            ca = self.access.endpoint(run.tailnet).ca
        except Problem:
            ca = None
        return build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                               auth_secret=self.key_secret_name(run.name), ca_bundle=ca,
                               operator_labels=self.settings.operator_labels,
                               metrics_namespaces=self.settings.metrics_namespaces)

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
        if node := node_status(agent):
            fields["node"] = node
        conds = [*self.key_conditions(key, run.egress.spec.tag), *_target_conditions(states)]
        if aliases := _aliases_condition(run):
            conds.append(aliases)
        await self.status.write(TAILNET_EGRESS, run.obj, conds, fields)


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
