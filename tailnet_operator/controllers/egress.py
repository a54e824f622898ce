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

from .access import Deps, NoAccess, Problem
from .agents import RESYNC_SECONDS, RETRY_SECONDS, AgentReconciler, node_status
from .conditions import Cond, Status
from .egress_status import AgentStatusReader, HttpAgentStatus, TargetState, classify
from .kinds import TAILNET_EGRESS
from .preauth import AuthKey, auth_key_secret_name

__all__ = ["FIELD_MANAGER", "EgressReconciler", "EgressSettings"]

log = structlog.get_logger("controllers.egress")

FIELD_MANAGER = "tailnet-operator-egress"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "TargetsReady")


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

    def key_secret_name(self, name: str) -> str:
        return auth_key_secret_name(name)

    @property
    def namespace(self) -> str:
        return self.access.namespace

    def accepts(self, request: Request) -> bool:
        return request.namespace == self.namespace  # elsewhere: the Policy reconciler records it once

    async def reconcile_one(self, obj: JSON, parsed: TailnetEgress, tailnet: Tailnet) -> Result:
        return await self._reconcile(Run(obj, parsed, tailnet))

    async def _reconcile(self, run: Run) -> Result:
        try:
            connection = self.access.working(run.tailnet)
        except NoAccess as exc:
            await self.not_ready(run.obj, "Unknown", "WaitingForAccess", str(exc))
            return Result(requeue_after=RETRY_SECONDS)
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
        await self._apply(run, key)
        await self._report(run, key, live, nodes)
        return Result(requeue_after=min(RESYNC_SECONDS, max(1.0, self.until(key.rotation_due))))

    # -- tag and key ----------------------------------------------------------------------------

    def _secret_metadata(self, run: Run) -> JSON:
        return build.owned_metadata(run.obj, run.egress, auth_key_secret_name(run.name))

    # -- objects --------------------------------------------------------------------------------

    def _agent(self, run: Run, key: AuthKey) -> build.AgentSpec:
        try:
            ca = self.access.endpoint(run.tailnet).ca
        except Problem:
            ca = None
        return build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                               auth_secret=auth_key_secret_name(run.name), ca_bundle=ca,
                               operator_labels=self.settings.operator_labels)

    async def _apply(self, run: Run, key: AuthKey) -> None:
        agent = self._agent(run, key)
        current = self.reader.get(CONFIG_MAP, build.config_map_name(run.egress), self.namespace)
        ports = build.listen_ports(run.egress, build.previous_listen_ports(current))
        await self._put(CONFIG_MAP, build.config_map(run.obj, run.egress, ports, agent.ca_bundle))
        await self._put(DEPLOYMENT, build.deployment(run.obj, run.egress, agent))
        await self._put(SERVICE, build.agent_service(run.obj, run.egress))
        for name in build.target_names(run.egress):
            await self._put(SERVICE, build.target_service(run.obj, run.egress, name, ports))
        await self._put(NETWORK_POLICY, build.network_policy(run.obj, run.egress, ports, agent))
        await self._remove_stale_services(run)

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

    async def _report(self, run: Run, key: AuthKey, live: str, nodes: list[Node]) -> None:
        agent = await self.agent_status.read(run.egress)
        states = [classify(run.egress, t, agent=agent, nodes=nodes, live_policy=live)
                  for t in run.egress.spec.targets]
        fields: JSON = {"preAuthKey": key.status(), "targets": [s.status() for s in states]}
        if node := node_status(agent):
            fields["node"] = node
        conds = [*self.key_conditions(key, run.egress.spec.tag), *_target_conditions(states)]
        await self.status.write(TAILNET_EGRESS, run.obj, conds, fields)


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
