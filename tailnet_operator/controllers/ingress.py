"""The Ingress reconciler: one TailnetIngress (in any namespace) becomes a tailnet node exposing
in-cluster Services.

The phases are the pipeline's (:mod:`.pipeline`: tenancy, tag pre-check, pre-auth key, apply,
status); this module says what an ingress adds:

* tenancy (:mod:`tailnet_operator.tenancy`): a namespace may use the Tailnet only as its grant
  allows, and names another object holds are refused; an ingress whose grant was narrowed loses
  its key and its node;
* its objects, in the CR's namespace (which must have granted the operator the ClusterRole
  ``tailnet-operator-tenant``, else Ready=False ``NamespaceNotGranted`` and no key is made), all
  owned by the CR: the exposes ConfigMap (the agent's exposes file, reloaded without a restart),
  the key Secret the agent mounts, the agent Deployment (``AGENT_MODE=ingress``, each host's TLS
  Secret and each https backend's CA projected), the agent's status Service, a NetworkPolicy that
  admits no pod but the operator, and for every ``tls.certManager`` host a cert-manager
  ``Certificate`` for the host's name and alias names. The key's record lives in the operator's
  namespace, where the tenant cannot write;
* its status (:mod:`.ingress_status`): the node, ``magicDNSName``, ``dnsNames``, one entry per
  expose from the agent's ``/status``, and the conditions. Before it, the name: once a restarted
  agent's node is online, the ingress's older offline nodes are deleted and the new one renamed to
  ``spec.hostname`` (Events ``SupersededNodeDeleted``, ``NodeRenamed``).

cert-manager's CRDs may be absent: the Certificate is written without a watch (its apply is
refused with 404 then, and the hosts that asked for it say so in CertificatesReady); the Secret
it fills is watched like any other. Deleting a CR expires its key (finalizer) and deletes its
record; garbage collection removes the rest, the DNS reconciler drops its names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import structlog
from pydantic import ValidationError

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleError, Node
from tailnet_operator.headscale import NotFound as HeadscaleNotFound
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.policy import parse_hujson
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.derive import Derived
from tailnet_operator.resources import ingress as build
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Request, Writer
from tailnet_operator.runtime.errors import Forbidden, NotFound
from tailnet_operator.runtime.kinds import CERTIFICATE, DEPLOYMENT, NETWORK_POLICY, POD_DISRUPTION_BUDGET
from tailnet_operator.tenancy import (
    Refusal,
    claim_order,
    claimed,
    judge,
    policy_reserved_tags,
    shared_routes,
    taken,
)
from tailnet_operator.types import JSON

from .access import Deps
from .applier import Applied, Desired, Want
from .conditions import Cond
from .dns import name_holders
from .egress_status import AgentStatusReader, HttpAgentStatus
from .ingress_status import CertificateIssue, Report, own_nodes, report, retired_name, rollout_done, succession
from .keyrecord import NODE_IDS
from .kinds import TAILNET_EGRESS, TAILNET_GATEWAY, TAILNET_INGRESS, TAILNET_SITE
from .pipeline import Outcome, Run, TaggedNodeReconciler
from .policy import TAILNET_INDEX
from .preauth import AuthKey

__all__ = ["CONDITION_TYPES", "FIELD_MANAGER", "IngressNode", "IngressSettings", "ingress_reconciler", "secret_users",
           "zones_of"]

log = structlog.get_logger("controllers.ingress")

FIELD_MANAGER = "tailnet-operator-ingress"
NODE_FIELD_MANAGER = "tailnet-operator-ingress-node"
"""Writes the node's addresses onto the record, apart from the key bookkeeping it applies."""
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "CertificatesReady", "ExposesReady", "HostnameAssigned",
                   "SharedAddressServed")


@dataclass(frozen=True)
class IngressSettings:
    """What the operator decides for every ingress agent: its image, and the operator's pods
    (labels and namespace) that the agent's NetworkPolicy admits to its health port."""

    agent_image: str
    operator_namespace: str
    operator_labels: dict[str, str] = field(default_factory=dict)
    tenant_role: str = "tailnet-operator-tenant"
    """The ClusterRole a namespace binds to let the operator write an ingress's objects there."""
    service_account: str = "tailnet-operator"
    metrics_namespaces: dict[str, str] = field(default_factory=dict)
    """Namespaces (by labels) admitted to the agents' /metrics: where Prometheus runs."""


def zones_of(tailnet: Tailnet) -> list[str]:
    """The Tailnet's DNS zones (none when it owns no hosts file)."""
    return [str(z) for z in tailnet.spec.dns.zones] if tailnet.spec.dns else []


def name_clash(ingress: TailnetIngress, zones: list[str]) -> str:
    """Why the exposes cannot be served as they are ("" when they can): the http exposes on one
    port are chosen by the name the client sends in SNI, so each name (a host's name, its alias and
    the alias under each zone) may belong to one host of them only."""
    owners: dict[tuple[int, str], str] = {}
    for expose in ingress.spec.exposes:
        for host in expose.hosts or []:
            names = [host.name.lower().rstrip("."), *([host.alias.lower()] if host.alias else []),
                     *build.alias_names(host, zones)]
            for name in dict.fromkeys(names):
                key = (expose.port, name)
                where = f"host {host.name} of expose {expose.name}"
                if key in owners:
                    return (f"{name} names both {owners[key]} and {where} on port {expose.port}: SNI could not "
                            "choose between them; give one of the hosts another alias or move its expose to "
                            "another port")
                owners[key] = where
    return ""


def secret_users(obj: JSON) -> set[str]:
    """The Secrets an ingress (as stored) reads: its hosts' TLS Secrets and its backends' CAs."""
    try:
        ingress = TailnetIngress.model_validate(obj)
    except ValidationError:
        return set()
    cas = {e.backend.ca_secret_ref.name for e in ingress.spec.exposes if e.backend.ca_secret_ref is not None}
    return {*build.tls_secret_names(ingress), *cas}


def ingress_reconciler(deps: Deps, writer: Writer, settings: IngressSettings, *,
                       agent_status: AgentStatusReader | None = None) -> TaggedNodeReconciler[TailnetIngress]:
    """The TailnetIngress reconciler; writes as :data:`FIELD_MANAGER` through ``writer``."""
    node = IngressNode(deps, writer, settings, agent_status or HttpAgentStatus(service=build.agent_name))
    return TaggedNodeReconciler(deps, writer, node)


class IngressNode:
    """What a TailnetIngress adds to the pipeline: tenancy, its objects in the tenant's namespace
    (its key recorded in the operator's), Certificates, and the exposes' status."""

    resource = TAILNET_INGRESS
    model = TailnetIngress
    field_manager = FIELD_MANAGER
    condition_types: tuple[str, ...] = CONDITION_TYPES

    def __init__(self, deps: Deps, writer: Writer, settings: IngressSettings, agent_status: AgentStatusReader) -> None:
        self.reader, self.access, self.events = deps.reader, deps.access, deps.events
        self.writer = writer
        self.settings = settings
        self.agent_status = agent_status

    def accepts(self, request: Request) -> bool:
        return True

    def spec_problem(self, run: Run[TailnetIngress]) -> tuple[str, str] | None:
        problem = name_clash(run.cr, zones_of(run.tailnet))
        return ("HostNameClash", problem) if problem else None

    def tailnet_name(self, cr: TailnetIngress) -> str:
        return cr.spec.tailnet_ref.name

    def tag(self, cr: TailnetIngress) -> str:
        return cr.spec.tag

    def derived(self, cr: TailnetIngress) -> Derived:
        return derive_from_objects(ingresses=[cr])

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """The ingress's record in the operator's namespace, which the tenant cannot write."""
        meta = obj["metadata"]
        return build.record_name(meta["namespace"], meta["name"]), self.settings.operator_namespace

    def key_metadata(self, run: Run[TailnetIngress]) -> JSON:
        return build.record_metadata(run.cr, self.settings.operator_namespace)

    # -- tenancy --------------------------------------------------------------------------------

    def refusal(self, run: Run[TailnetIngress], live_policy: str | None) -> Refusal | None:
        """Why the ingress's namespace may not use the Tailnet as it asks (None when it may).
        Before the live policy is read only the ingress itself is judged; after, also whether
        another object holds one of its names (a pass over the Tailnet's ingresses)."""
        reserved = self._cluster_tags()
        if live_policy:
            reserved |= policy_reserved_tags(parse_hujson(live_policy), shared=self._shared_routes(run.tailnet))
        zones = zones_of(run.tailnet)
        names = build.dns_names(run.cr, zones) if run.tailnet.spec.dns is not None else []
        if (refusal := judge(run.cr, run.tailnet, reserved=reserved, names=names)) is not None or live_policy is None:
            return refusal
        holders = name_holders(self.reader, run.tailnet, self.settings.operator_namespace, reserved=reserved)
        return taken(claimed(run.cr, names), claim_order(run.obj), holders)

    def _shared_routes(self, tailnet: Tailnet) -> dict[str, set[str]]:
        """The granted shared-address routes of the ingresses that parse, with the tags claiming each."""
        ingresses = []
        for obj in self.reader.list(TAILNET_INGRESS, index=(TAILNET_INDEX, str(tailnet.metadata.name))):
            with contextlib.suppress(ValidationError):
                if (parsed := self.reader.get(TailnetIngress, obj["metadata"]["name"],
                                              obj["metadata"].get("namespace"))) is not None:
                    ingresses.append(parsed)
        return shared_routes(ingresses, tailnet)

    def _cluster_tags(self) -> set[str]:
        """The tags of every egress, gateway and site router: the platform's, never a tenant's by prefix."""
        tags = set()
        for kind, field_name in ((TAILNET_EGRESS, "tag"), (TAILNET_GATEWAY, "tag"), (TAILNET_SITE, "routerTag")):
            for obj in self.reader.list(kind):
                if isinstance(tag := (obj.get("spec") or {}).get(field_name), str):
                    tags.add(tag)
        return tags

    def not_granted(self, run: Run[TailnetIngress], exc: Forbidden) -> str:
        settings, namespace = self.settings, run.namespace
        return (f"the operator may not write in namespace {namespace}; nothing was created on the tailnet. "
                f"Let it in by binding the ClusterRole {settings.tenant_role} there: kubectl -n {namespace} "
                f"create rolebinding tailnet-operator --clusterrole={settings.tenant_role} "
                f"--serviceaccount={settings.operator_namespace}:{settings.service_account} "
                f"(kube-apiserver said: {exc})")

    # -- objects --------------------------------------------------------------------------------

    def before_key(self, run: Run[TailnetIngress]) -> Desired:
        """The exposes first: a namespace that has not let the operator in is found out before a
        key is made that could not be stored."""
        zones = zones_of(run.tailnet)
        return Desired.of((CONFIG_MAP, build.config_map(run.obj, run.cr, zones, self.access.agent_ca(run.tailnet))))

    def desired(self, run: Run[TailnetIngress], key: AuthKey) -> Desired:
        owner, ingress, zones = run.obj, run.cr, zones_of(run.tailnet)
        agent = build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                                auth_secret=auth_key_secret_name(TAILNET_INGRESS.kind, str(ingress.metadata.name)),
                                ca_bundle=self.access.agent_ca(run.tailnet),
                                operator_labels=self.settings.operator_labels,
                                metrics_namespaces=self.settings.metrics_namespaces)
        certificates = [Want(CERTIFICATE, build.certificate(owner, ingress, host, zones), optional=True)
                        for host in build.cert_manager_hosts(ingress)]
        budget = build.disruption_budget(owner, ingress)
        return Desired.of((SECRET, build.auth_secret(owner, ingress, key.key)),
                          (DEPLOYMENT, build.deployment(owner, ingress, agent)),
                          (SERVICE, build.agent_service(owner, ingress)),
                          (NETWORK_POLICY, build.network_policy(owner, ingress, agent,
                                                                self.settings.operator_namespace)),
                          *certificates,
                          *([(POD_DISRUPTION_BUDGET, budget)] if budget else []),
                          prune=[(POD_DISRUPTION_BUDGET, run.namespace)])

    # -- status ---------------------------------------------------------------------------------

    async def report(self, run: Run[TailnetIngress], outcome: Outcome) -> tuple[list[Cond], JSON]:
        nodes = await self.free_hostname(run, outcome)
        agent = await self.agent_status.read(run.cr)
        result: Report = report(run.cr, zones_of(run.tailnet), agent=agent, nodes=nodes, key=outcome.key,
                                reader=self.reader, issues=_certificate_issues(run.cr, outcome.applied),
                                dns=run.tailnet.spec.dns is not None)
        await self.record_node(self.key_location(run.obj), outcome.key, result.fields.get("node"), nodes)
        return result.conditions, result.fields

    async def free_hostname(self, run: Run[TailnetIngress], outcome: Outcome) -> list[Node]:
        """Give ``spec.hostname`` to the ingress's newest online node (:func:`.ingress_status.succession`):
        delete its superseded nodes, rename a draining one that holds the name, then rename the newest,
        each with a Normal Event. Returns the nodes as they are afterwards. A Headscale failure is
        logged and left to the next reconcile (the status still reports ``HostnameTaken``).

        The renames of a hand-over go to Headscale together (:meth:`HeadscaleClient.rename_nodes`)
        and their Events are written after them: Headscale applies them in one batch, so its peers
        never get a netmap in which no node carries the name."""
        hostname = run.cr.spec.hostname
        deployment = outcome.applied.get(DEPLOYMENT, build.agent_name(run.cr))
        plan = succession(hostname, outcome.key, outcome.nodes, rolled_out=rollout_done(deployment),
                          replicas=run.cr.spec.replicas)
        if plan is None:
            return outcome.nodes
        after, hs = list(outcome.nodes), outcome.headscale
        notes: list[tuple[str, str, str]] = []
        try:
            for old in plan.superseded:
                with contextlib.suppress(HeadscaleNotFound):
                    await hs.delete_node(old.id)
                after = [n for n in after if n.id != old.id]
                notes.append(("SupersededNodeDeleted", "DeleteNode", (
                    f"deleted node {old.id} ({old.given_name}, offline), superseded by node "
                    f"{plan.newest.id} ({plan.newest.given_name}) registered with a key of this ingress")))
            if plan.rename:
                retiring = [(old.id, retired_name(hostname, old)) for old in plan.retiring]
                renamed = {n.id: n for n in await hs.rename_nodes(retiring, (plan.newest.id, hostname),
                                                                   last_name=plan.newest.given_name)}
                after = [renamed.get(n.id, n) for n in after]
                notes += [("NodeRenamed", "RenameNode", (
                    f"renamed node {old.id} from {hostname} to {name}: it hands the name to node "
                    f"{plan.newest.id}, whose pod is ready, and serves who resolved it before until it has "
                    "drained")) for (_, name), old in zip(retiring, plan.retiring, strict=True)]
                notes.append(("NodeRenamed", "RenameNode", (
                    f"renamed node {plan.newest.id} from {plan.newest.given_name} to {hostname}: "
                    "the name its previous node held")))
        except HeadscaleError as exc:
            log.warning("could not free the ingress's hostname", ingress=f"{run.namespace}/{run.name}",
                        node=plan.newest.id, error=str(exc))
        for reason, action, note in notes:
            await self.events.normal(run.obj, reason, note, action=action)
        return after

    async def record_node(self, location: tuple[str, str | None], key: AuthKey, node: JSON | None,
                          nodes: list[Node]) -> None:
        """Note on the record at ``location`` the node's addresses (from Headscale), where the DNS
        reconciler reads them, and the ids of the ingress's nodes, which stay its own after their key
        is retired (succession, revocation). One field manager owns both, so both are sent each time."""
        name, namespace = location
        record = self.reader.get(SECRET, name, namespace) or {}
        notes = (record.get("metadata") or {}).get("annotations") or {}
        # no node yet keeps the last address (a restart does not empty DNS)
        addresses = ",".join((node or {}).get("addresses") or []) or notes.get(build.NODE_ADDRESS_ANNOTATION, "")
        ids = ",".join(sorted(n.id for n in own_nodes(key, nodes)))
        wanted = {k: v for k, v in ((build.NODE_ADDRESS_ANNOTATION, addresses), (NODE_IDS, ids)) if v}
        if all(notes.get(k) == v for k, v in wanted.items()) and (NODE_IDS in wanted or NODE_IDS not in notes):
            return
        await self.writer.apply(SECRET, {"metadata": {"name": name, "namespace": namespace, "annotations": wanted}},
                                field_manager=NODE_FIELD_MANAGER)


def _certificate_issues(ingress: TailnetIngress, applied: Applied) -> dict[str, CertificateIssue]:
    """By host name, why the Certificate a ``tls.certManager`` host asked for was not written."""
    issues: dict[str, CertificateIssue] = {}
    for expose in ingress.spec.exposes:
        for host in expose.hosts or []:
            if host.tls is None:
                continue
            exc = applied.refused.get((CERTIFICATE.kind, build.certificate_name(ingress, host)))
            if exc is None:
                continue
            if isinstance(exc, NotFound):
                issues[host.name] = CertificateIssue(
                    "CertManagerNotInstalled",
                    f"{host.name} asks for a certificate from cert-manager (tls.certManager), but the "
                    "cert-manager.io/v1 Certificate kind does not exist in this cluster: install "
                    "cert-manager (its CRDs and controller), or give the host a kubernetes.io/tls "
                    "Secret with tls.secretName")
            else:
                issues[host.name] = CertificateIssue(
                    "CertificateNotCreated", f"the Certificate for {host.name} could not be written: {exc}")
    return issues
