"""The Ingress reconciler: one TailnetIngress (in any namespace) becomes a tailnet node exposing
in-cluster Services.

Per CR, in this order, so nothing reaches the tailnet unless the policy owns the tag:

1. tag pre-check against the live policy: a tag the policy does not own is Ready=False
   ``TagNotOwned`` with a paste-ready snippet, and nothing is created on the tailnet;
2. the pre-auth key (:mod:`.preauth`, shared with egress through :mod:`.agents`);
3. in the CR's namespace (which must have granted the operator the ClusterRole
   ``tailnet-operator-tenant``, else Ready=False ``NamespaceNotGranted`` and no key is made), all
   server-side applied and owned by the CR: the exposes ConfigMap (the agent's exposes file,
   reloaded without a restart), the agent Deployment (``AGENT_MODE=ingress``,
   each host's TLS Secret and each https backend's CA projected), the agent's status Service, a
   NetworkPolicy that admits no pod but the operator, and for every ``tls.certManager`` host a
   cert-manager ``Certificate`` for the host's name and alias names;
4. status (:mod:`.ingress_status`): the node, ``magicDNSName``, ``dnsNames``, one entry per
   expose from the agent's ``/status``, and the conditions.

cert-manager's CRDs may be absent: the Certificate is written without a watch (its apply is
refused with 404 then, and the hosts that asked for it say so in CertificatesReady); the Secret
it fills is watched like any other. Deleting a CR expires its key (finalizer); garbage
collection removes the rest, the DNS reconciler drops its names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import structlog
from pydantic import ValidationError

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node
from tailnet_operator.policy import PolicyParseError, parse_hujson
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.resources import ingress as build
from tailnet_operator.runtime import (
    CONFIG_MAP,
    SECRET,
    SERVICE,
    Resource,
    Result,
    Writer,
)
from tailnet_operator.runtime.errors import APIError, Forbidden, NotFound
from tailnet_operator.runtime.kinds import CERTIFICATE, DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.tenancy import Refusal, claim_order, judge, policy_reserved_tags, taken
from tailnet_operator.types import JSON

from .access import Deps, Problem
from .agents import RESYNC_SECONDS, RETRY_SECONDS, AgentReconciler
from .conditions import Cond
from .dns import name_holders
from .egress_status import AgentStatusReader, HttpAgentStatus
from .ingress_status import CertificateIssue, Report, report
from .kinds import TAILNET_EGRESS, TAILNET_GATEWAY, TAILNET_INGRESS, TAILNET_SITE
from .preauth import AuthKey

__all__ = ["CONDITION_TYPES", "FIELD_MANAGER", "IngressReconciler", "IngressSettings", "secret_users", "zones_of"]

log = structlog.get_logger("controllers.ingress")

FIELD_MANAGER = "tailnet-operator-ingress"
NODE_FIELD_MANAGER = "tailnet-operator-ingress-node"
"""Writes the node's addresses onto the record, apart from the key bookkeeping it applies."""
CONDITION_TYPES = ("TagOwned", "PreAuthKeyValid", "CertificatesReady", "ExposesReady", "HostnameAssigned")


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


@dataclass(frozen=True)
class Run:
    """One reconcile of one TailnetIngress."""

    obj: JSON
    ingress: TailnetIngress
    tailnet: Tailnet

    @property
    def name(self) -> str:
        return str(self.ingress.metadata.name)

    @property
    def namespace(self) -> str:
        return str(self.ingress.metadata.namespace)

    @property
    def zones(self) -> list[str]:
        return zones_of(self.tailnet)


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


class IngressReconciler(AgentReconciler):
    """Reconciles one TailnetIngress; writes as :data:`FIELD_MANAGER` through ``writer``."""

    kind = TAILNET_INGRESS
    model = TailnetIngress
    condition_types = CONDITION_TYPES

    def __init__(self, deps: Deps, writer: Writer, settings: IngressSettings, *,
                 agent_status: AgentStatusReader | None = None) -> None:
        super().__init__(deps, writer, field_manager=FIELD_MANAGER)
        self.settings = settings
        self.agent_status = agent_status or HttpAgentStatus(service=build.agent_name)

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """The ingress's record in the operator's namespace, which the tenant cannot write."""
        meta = obj["metadata"]
        return build.record_name(meta["namespace"], meta["name"]), self.settings.operator_namespace

    def spec_problem(self, parsed: TailnetIngress) -> tuple[str, str] | None:
        tailnet = self.reader.get(Tailnet, parsed.spec.tailnet_ref.name)
        problem = name_clash(parsed, zones_of(tailnet) if tailnet is not None else [])
        return ("HostNameClash", problem) if problem else None

    async def reconcile_one(self, obj: JSON, parsed: TailnetIngress, tailnet: Tailnet) -> Result:
        return await self._reconcile(Run(obj, parsed, tailnet))

    async def _reconcile(self, run: Run) -> Result:
        first_time = self._record(run.obj) is None
        if first_time and (refusal := self._tenancy(run, reserved=self._cluster_tags(), claims=False)) is not None:
            return await self._refuse(run, refusal)  # nothing to revoke: not even the live policy is read
        connection = await self.working_connection(run.obj, run.tailnet)
        if isinstance(connection, Result):
            return connection
        tag = run.ingress.spec.tag
        try:
            async with self.access.open(connection) as hs:
                live, _ = await hs.get_policy()
                reserved = self._cluster_tags() | (policy_reserved_tags(parse_hujson(live)) if live else set())
                if (refusal := self._tenancy(run, reserved=reserved)) is not None:
                    return await self._refuse(run, refusal, hs)
                if snippet := self.tag_gap(live, derive_from_objects(ingresses=[run.ingress]), tag):
                    await self.tag_not_owned(run.obj, tag, snippet)
                    return Result(requeue_after=RESYNC_SECONDS)
                # The exposes first: a namespace that has not let the operator in is found out
                # before a key is made that could not be stored.
                await self._put(CONFIG_MAP, build.config_map(run.obj, run.ingress, run.zones, self._ca(run)))
                record = build.record_metadata(run.ingress, self.settings.operator_namespace)
                key = await self.ensure_key(hs, run.obj, record, run.tailnet, tag)
                await self._put(SECRET, build.auth_secret(run.obj, run.ingress, key.key))
                nodes = await hs.list_nodes()
                await self._apply(run, key)
        except (HeadscaleError, PolicyParseError) as exc:
            await self.not_ready(run.obj, "Unknown", "HeadscaleUnavailable", f"Headscale: {exc}")
            return Result(requeue_after=RETRY_SECONDS)
        except Forbidden as exc:
            await self.not_ready(run.obj, "False", "NamespaceNotGranted", self._not_granted(run, exc))
            return Result(requeue_after=RESYNC_SECONDS)
        issues = await self._certificates(run)
        await self._report(run, key, nodes, issues)
        return Result(requeue_after=min(RESYNC_SECONDS, max(1.0, self.until(key.rotation_due))))

    # -- tenancy --------------------------------------------------------------------------------

    def _cluster_tags(self) -> set[str]:
        """The tags of every egress, gateway and site router: the platform's, never a tenant's by prefix."""
        tags = set()
        for kind, field_name in ((TAILNET_EGRESS, "tag"), (TAILNET_GATEWAY, "tag"), (TAILNET_SITE, "routerTag")):
            for obj in self.reader.list(kind):
                if isinstance(tag := (obj.get("spec") or {}).get(field_name), str):
                    tags.add(tag)
        return tags

    def _record(self, obj: JSON) -> AuthKey | None:
        """The key the ingress's record holds (None before its first key)."""
        return AuthKey.from_secret(self.reader.get(SECRET, *self.key_location(obj)))

    def _tenancy(self, run: Run, *, reserved: set[str], claims: bool = True) -> Refusal | None:
        """Why the ingress's namespace may not use the Tailnet as it asks (None when it may);
        ``claims``: also whether another object holds one of its names (a pass over the Tailnet's
        ingresses, so done once per reconcile)."""
        names = build.dns_names(run.ingress, run.zones) if run.tailnet.spec.dns is not None else []
        if (refusal := judge(run.ingress, run.tailnet, reserved=reserved, names=names)) is not None or not claims:
            return refusal
        holders = name_holders(self.reader, run.tailnet, self.settings.operator_namespace, reserved=reserved)
        return taken(names, claim_order(run.obj), holders)

    async def _refuse(self, run: Run, refusal: Refusal, hs: HeadscaleClient | None = None) -> Result:
        """Report the refusal; with ``hs``, an ingress that had a key (its tenancy was narrowed)
        loses it and its node."""
        if hs is not None and (stored := self._record(run.obj)) is not None:
            await self._revoke(run, stored, hs)
        await self.status.write(self.kind, run.obj, [Cond("Ready", "False", refusal.reason, refusal.message)],
                                keep=self.condition_types)
        await self.events.warning(run.obj, refusal.reason, refusal.message, action="Admit")
        return Result(requeue_after=RESYNC_SECONDS)

    async def _revoke(self, run: Run, stored: AuthKey, hs: HeadscaleClient) -> None:
        """Expire the ingress's keys, delete the nodes registered with them and forget the record."""
        await self.keys.expire(hs, stored)
        ids = {stored.id, stored.previous_id} - {""}
        for node in await hs.list_nodes():
            if node.pre_auth_key_id in ids:
                await hs.delete_node(node.id)
        name, namespace = self.key_location(run.obj)
        with contextlib.suppress(NotFound):
            await self.writer.delete(SECRET, name, namespace)

    # -- objects --------------------------------------------------------------------------------

    def _ca(self, run: Run) -> str | None:
        try:
            return self.access.endpoint(run.tailnet).ca
        except Problem:
            return None

    def _agent(self, run: Run, key: AuthKey) -> build.AgentSpec:
        return build.AgentSpec(image=self.settings.agent_image, control_url=key.login_url,
                               auth_secret=self.key_secret_name(run.name), ca_bundle=self._ca(run),
                               operator_labels=self.settings.operator_labels,
                               metrics_namespaces=self.settings.metrics_namespaces)

    def _not_granted(self, run: Run, exc: Forbidden) -> str:
        settings = self.settings
        return (f"the operator may not write in namespace {run.namespace}; nothing was created on the tailnet. "
                f"Let it in by binding the ClusterRole {settings.tenant_role} there: kubectl -n {run.namespace} "
                f"create rolebinding tailnet-operator --clusterrole={settings.tenant_role} "
                f"--serviceaccount={settings.operator_namespace}:{settings.service_account} "
                f"(kube-apiserver said: {exc})")

    async def _apply(self, run: Run, key: AuthKey) -> None:
        agent = self._agent(run, key)
        await self._put(DEPLOYMENT, build.deployment(run.obj, run.ingress, agent))
        await self._put(SERVICE, build.agent_service(run.obj, run.ingress))
        await self._put(NETWORK_POLICY, build.network_policy(run.obj, run.ingress, agent,
                                                             self.settings.operator_namespace))

    async def _put(self, resource: Resource, body: JSON) -> None:
        await self.writer.apply(resource, body, field_manager=FIELD_MANAGER)

    async def _certificates(self, run: Run) -> dict[str, CertificateIssue]:
        """Apply the Certificate of every ``tls.certManager`` host; by host name, what went wrong."""
        issues: dict[str, CertificateIssue] = {}
        for expose in run.ingress.spec.exposes:
            for host in expose.hosts or []:
                if host.tls.cert_manager is None:
                    continue
                try:
                    await self._put(CERTIFICATE, build.certificate(run.obj, run.ingress, host, run.zones))
                except NotFound:
                    issues[host.name] = CertificateIssue(
                        "CertManagerNotInstalled",
                        f"{host.name} asks for a certificate from cert-manager (tls.certManager), but the "
                        "cert-manager.io/v1 Certificate kind does not exist in this cluster: install "
                        "cert-manager (its CRDs and controller), or give the host a kubernetes.io/tls "
                        "Secret with tls.secretName")
                except APIError as exc:
                    issues[host.name] = CertificateIssue(
                        "CertificateNotCreated", f"the Certificate for {host.name} could not be written: {exc}")
        return issues

    # -- status ---------------------------------------------------------------------------------

    async def _report(self, run: Run, key: AuthKey, nodes: list[Node], issues: dict[str, CertificateIssue]) -> None:
        agent = await self.agent_status.read(run.ingress)
        result: Report = report(run.ingress, run.zones, agent=agent, nodes=nodes, key=key, reader=self.reader,
                                issues=issues, dns=run.tailnet.spec.dns is not None)
        fields: JSON = {"preAuthKey": key.status(), **result.fields}
        conds = [*self.key_conditions(key, run.ingress.spec.tag), *result.conditions]
        await self._record_address(run, result.fields.get("node"))
        await self.status.write(TAILNET_INGRESS, run.obj, conds, fields)

    async def _record_address(self, run: Run, node: JSON | None) -> None:
        """Note the node's addresses (from Headscale) on the record, where the DNS reconciler reads them."""
        name, namespace = self.key_location(run.obj)
        record = self.reader.get(SECRET, name, namespace) or {}
        addresses = ",".join((node or {}).get("addresses") or [])
        notes = (record.get("metadata") or {}).get("annotations") or {}
        if not addresses or notes.get(build.NODE_ADDRESS_ANNOTATION) == addresses:
            return  # no node yet keeps the last address (a restart does not empty DNS)
        await self.writer.apply(SECRET, {"metadata": {"name": name, "namespace": namespace, "annotations": {
            build.NODE_ADDRESS_ANNOTATION: addresses}}}, field_manager=NODE_FIELD_MANAGER)

    async def forget_key(self, obj: JSON) -> None:
        """The record lives in the operator's namespace, where nothing owns it: removed here."""
        name, namespace = self.key_location(obj)
        with contextlib.suppress(NotFound):
            await self.writer.delete(SECRET, name, namespace)
