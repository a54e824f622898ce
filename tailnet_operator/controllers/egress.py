"""The Egress reconciler: one TailnetEgress (operator namespace only) becomes a tailnet node.

The phases are the pipeline's (:mod:`.pipeline`: tag pre-check, pre-auth key, apply, status);
this module says what an egress adds:

* its objects: the agent's ConfigMap (targets, CA), Deployment, one Service per target, the
  agent's status Service and a NetworkPolicy, all owned by the CR; Services of removed targets
  are pruned, and a target whose Service another egress holds is reported, not taken;
* its status: ``node`` and every target's route state from the agent's ``/status`` refined with
  Headscale (:mod:`.egress_status`), ``TargetsReady`` and ``AliasesServed``.

A TailnetEgress in any other namespace is never acted on (the Policy reconciler reports it).
Deleting a CR expires its key (finalizer); garbage collection removes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.derive import Derived
from tailnet_operator.resources import egress as build
from tailnet_operator.runtime import CONFIG_MAP, SERVICE, Request, Writer
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY, POD_DISRUPTION_BUDGET
from tailnet_operator.tenancy import Refusal
from tailnet_operator.types import JSON

from .access import Deps
from .applier import Desired
from .conditions import Cond, Status
from .dns import in_zone
from .egress_status import AgentStatusReader, HttpAgentStatus, TargetState, classify
from .kinds import TAILNET_EGRESS
from .pipeline import Outcome, Run, TaggedNodeReconciler, node_status
from .preauth import AuthKey

__all__ = ["FIELD_MANAGER", "EgressNode", "EgressSettings", "egress_reconciler"]

FIELD_MANAGER = "tailnet-operator-egress"
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "TargetsReady", "AliasesServed")


@dataclass(frozen=True)
class EgressSettings:
    """What the operator decides for every agent: its image and who may read its /status."""

    agent_image: str
    operator_labels: dict[str, str] = field(default_factory=dict)
    metrics_namespaces: dict[str, str] = field(default_factory=dict)
    """Namespaces (by labels) admitted to the agents' /metrics: where Prometheus runs."""


def egress_reconciler(deps: Deps, writer: Writer, settings: EgressSettings, *,
                      agent_status: AgentStatusReader | None = None) -> TaggedNodeReconciler[TailnetEgress]:
    """The TailnetEgress reconciler; writes as :data:`FIELD_MANAGER` through ``writer``."""
    return TaggedNodeReconciler(deps, writer, EgressNode(deps, settings, agent_status or HttpAgentStatus()))


class EgressNode:
    """What a TailnetEgress adds to the pipeline; acts only in the operator's namespace."""

    resource = TAILNET_EGRESS
    model = TailnetEgress
    field_manager = FIELD_MANAGER
    condition_types: tuple[str, ...] = CONDITION_TYPES

    def __init__(self, deps: Deps, settings: EgressSettings, agent_status: AgentStatusReader) -> None:
        self.reader, self.access = deps.reader, deps.access
        self.settings = settings
        self.agent_status = agent_status

    @property
    def namespace(self) -> str:
        return self.access.namespace

    def accepts(self, request: Request) -> bool:
        return request.namespace == self.namespace  # elsewhere: the Policy reconciler records it once

    def spec_problem(self, run: Run[TailnetEgress]) -> tuple[str, str] | None:
        return None

    def tailnet_name(self, cr: TailnetEgress) -> str:
        return cr.spec.tailnet_ref.name

    def tag(self, cr: TailnetEgress) -> str:
        return cr.spec.tag

    def derived(self, cr: TailnetEgress) -> Derived:
        return derive_from_objects(egresses=[cr])

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """Beside the CR, owned by it."""
        return auth_key_secret_name(TAILNET_EGRESS.kind, obj["metadata"]["name"]), obj["metadata"].get("namespace")

    def key_metadata(self, run: Run[TailnetEgress]) -> JSON:
        return build.owned_metadata(run.obj, run.cr, self.key_location(run.obj)[0])

    def refusal(self, run: Run[TailnetEgress], live_policy: str | None) -> Refusal | None:
        return None  # only the platform's namespace has egresses

    def before_key(self, run: Run[TailnetEgress]) -> Desired:
        return Desired.of()

    def desired(self, run: Run[TailnetEgress], key: AuthKey) -> Desired:
        egress, owner = run.cr, run.obj
        agent = build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                                auth_secret=self.key_location(owner)[0], ca_bundle=self.access.agent_ca(run.tailnet),
                                operator_labels=self.settings.operator_labels,
                                metrics_namespaces=self.settings.metrics_namespaces)
        current = self.reader.get(CONFIG_MAP, build.config_map_name(egress), self.namespace)
        ports = build.listen_ports(egress, build.previous_listen_ports(current))
        targets = [(SERVICE, build.target_service(owner, egress, name, ports))
                   for name in build.target_names(egress) if not self.service_holder(run, name)]
        budget = build.disruption_budget(owner, egress)
        return Desired.of((CONFIG_MAP, build.config_map(owner, egress, ports, agent.ca_bundle)),
                          (DEPLOYMENT, build.deployment(owner, egress, agent)),
                          (SERVICE, build.agent_service(owner, egress)),
                          *targets,
                          (NETWORK_POLICY, build.network_policy(owner, egress, ports, agent)),
                          *([(POD_DISRUPTION_BUDGET, budget)] if budget else []),
                          prune=[(SERVICE, self.namespace), (POD_DISRUPTION_BUDGET, self.namespace)])

    def service_holder(self, run: Run[TailnetEgress], name: str) -> str:
        """Who holds the Service a target needs when it is not this CR ("" when free or ours).

        Target names share the operator namespace: the first egress to create ``<name>`` keeps
        it, and a later one is told, rather than the two taking the Service from each other."""
        svc = self.reader.get(SERVICE, name, self.namespace)
        if svc is None:
            return ""
        refs = svc["metadata"].get("ownerReferences") or []
        if any(ref.get("uid") == run.uid for ref in refs):
            return ""
        owner = next((ref for ref in refs if ref.get("controller")), None)
        return f"{owner['kind']} {owner['name']}" if owner else "a Service this operator does not manage"

    def not_granted(self, run: Run[TailnetEgress], exc: Forbidden) -> str:
        return (f"the operator may not write in its own namespace {self.namespace}; check its Role there "
                f"(the chart's or manifests/install's) (kube-apiserver said: {exc})")

    async def report(self, run: Run[TailnetEgress], outcome: Outcome) -> tuple[list[Cond], JSON]:
        agent = await self.agent_status.read(run.cr)
        states = [_conflict(run.cr, t.name, holder) if (holder := self.service_holder(run, t.name))
                  else classify(run.cr, t, agent=agent, nodes=outcome.nodes, live_policy=outcome.live_policy)
                  for t in run.cr.spec.targets]
        fields: JSON = {"targets": [s.status() for s in states]}
        if node := node_status(agent):
            fields["node"] = node
        conds = _target_conditions(states)
        if aliases := _aliases_condition(run):
            conds.append(aliases)
        return conds, fields


def _aliases_condition(run: Run[TailnetEgress]) -> Cond | None:
    """AliasesServed: every alias lies in one of the Tailnet's DNS zones (None without aliases).

    The hosts file only answers inside ``spec.dns.zones`` (that is what the cluster's DNS forwards
    to it), so the DNS reconciler leaves other aliases out and this says which and why."""
    aliases = [str(a).lower().rstrip(".") for t in run.cr.spec.targets for a in t.aliases or []]
    if not aliases:
        return None
    dns = run.tailnet.spec.dns
    if dns is None:
        return Cond("AliasesServed", "False", "NoHostsFile",
                    f"the Tailnet {run.tailnet.metadata.name} has no spec.dns, so no alias resolves: "
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
