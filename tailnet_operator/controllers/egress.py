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
from datetime import datetime, timedelta

import structlog
from pydantic import ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node
from tailnet_operator.policy import PolicyParseError, missing
from tailnet_operator.policy.adapters import derive_from_objects
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
from .egress_status import AgentStatusReader, HttpAgentStatus, TargetState, classify
from .kinds import TAILNET_EGRESS
from .preauth import AuthKey, AuthKeyKeeper, Wanted, auth_key_secret_name
from .status import StatusWriter

__all__ = ["FIELD_MANAGER", "EgressReconciler", "EgressSettings"]

log = structlog.get_logger("controllers.egress")

FIELD_MANAGER = "tailnet-operator-egress"
RESYNC_SECONDS = 30.0
"""Routes and the agent's view change on their own; status is refreshed this often."""
RETRY_SECONDS = 10.0
FINALIZE_GIVE_UP = timedelta(minutes=5)
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "TargetsReady")


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
        try:
            egress = TailnetEgress.model_validate(obj)
        except ValidationError as exc:
            await self._not_ready(obj, "False", "InvalidSpec", str(exc).splitlines()[0])
            return Result()
        tailnet = self.reader.get(Tailnet, egress.spec.tailnet_ref.name)
        if tailnet is None:
            await self._not_ready(obj, "False", "TailnetNotFound",
                                  f"the Tailnet {egress.spec.tailnet_ref.name} does not exist")
            return Result(requeue_after=RESYNC_SECONDS)
        if not has_finalizer(obj, FINALIZER):
            await add_finalizer(self.writer, TAILNET_EGRESS, obj, FINALIZER)
        return await self._reconcile(Run(obj, egress, tailnet))

    async def _reconcile(self, run: Run) -> Result:
        try:
            connection = self.access.working(run.tailnet)
        except NoAccess as exc:
            await self._not_ready(run.obj, "Unknown", "WaitingForAccess", str(exc))
            return Result(requeue_after=RETRY_SECONDS)
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
        await self._apply(run, key)
        await self._report(run, key, live, nodes)
        return Result(requeue_after=min(RESYNC_SECONDS, max(1.0, self._until(key.rotation_due))))

    def _until(self, moment: datetime) -> float:
        return (moment - self.clock.utcnow()).total_seconds()

    # -- tag and key ----------------------------------------------------------------------------

    def _tag_gap(self, run: Run, live: str) -> str:
        """The snippet that would make the live policy own the tag ("" when it does)."""
        gap = missing(live or None, derive_from_objects(egresses=[run.egress]))
        return gap.snippet if run.egress.spec.tag in gap.tags else ""

    async def _tag_not_owned(self, run: Run, snippet: str) -> None:
        message = (f"the live policy does not own {run.egress.spec.tag}; nothing was created on the tailnet. "
                   f"Add this to the policy (or set spec.policy on the Tailnet to let the operator do it):\n"
                   f"{snippet}")
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
                               operator_labels=self.settings.operator_labels,
                               metrics_namespaces=self.settings.metrics_namespaces)

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
        if node := _node_status(agent):
            fields["node"] = node
        owned = f"the live policy owns {run.egress.spec.tag}"
        conds = [Cond("TagOwned", "True", "TagOwned", owned),
                 Cond("PreAuthKeyValid", "True", "KeyValid", f"pre-auth key {key.prefix} valid until "
                      f"{key.expires_at.isoformat()}"),
                 *_target_conditions(states)]
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
                if self._still_trying(obj):
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

    def _still_trying(self, obj: JSON) -> bool:
        deleted = datetime.fromisoformat(obj["metadata"]["deletionTimestamp"].replace("Z", "+00:00"))
        return self.clock.utcnow() - deleted < FINALIZE_GIVE_UP


def _node_status(agent: JSON | None) -> JSON | None:
    node = (agent or {}).get("node")
    if not isinstance(node, dict) or not node.get("id"):
        return None
    return {"id": str(node["id"]), "name": str(node.get("name") or ""),
            "addresses": [str(a) for a in node.get("addresses") or []]}


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
