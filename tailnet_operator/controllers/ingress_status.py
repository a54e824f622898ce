"""The status of a TailnetIngress: its node, its names, its certificates and every expose.

The agent's ``GET /status`` (:class:`tailnet_agent.contract.status.IngressStatus`) says, per expose,
whether its tailnet listener is bound, whether the last probe of the backend connected, and for
http exposes each host's certificate (``notAfter``, or why its files do not load). The cache says
whether each host's TLS Secret exists; the reconciler says what cert-manager answered. Headscale
gives the node: the one its pre-auth key registered (:func:`ingress_node`).

A restarted agent registers a new ephemeral node while its old one may still hold the hostname,
so Headscale names the new one ``<hostname>-<suffix>``. :func:`succession` says what to tidy once
the newest node of the ingress's keys is online: its older offline nodes go, an older node still
online (the old pod of a rollout) hands the name over once the new pod is ready and drains under
another name, and the newest is renamed to ``spec.hostname`` (the reconciler does all three, with
Events).

Conditions (docs/reference/status.md):

* ``CertificatesReady``: every http host's Secret exists with ``tls.crt`` and ``tls.key``;
  otherwise the first of ``CertManagerNotInstalled``, ``CertificateNotCreated``,
  ``CertificatePending``, ``SecretMissing``, ``SecretInvalid`` (the message lists every host);
* ``ExposesReady``: every expose listens (and its certificates load); otherwise ``NotListening``,
  ``BackendUnreachable``, ``CertificateError``, or Unknown ``AgentStatusUnknown``;
* ``Ready``: the first of those that is not True.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from tailnet_agent.contract.addresses import host_route
from tailnet_operator.api.ingress import Expose, TailnetIngress, VirtualHost
from tailnet_operator.headscale import Node
from tailnet_operator.resources import ingress as build
from tailnet_operator.runtime import SECRET, Reader
from tailnet_operator.types import JSON

from .conditions import Cond, Status
from .pipeline import node_status
from .preauth import AuthKey

__all__ = ["CertificateIssue", "ExposeState", "KeyIds", "Report", "Succession", "ingress_node", "own_nodes", "report",
           "succession"]


@dataclass(frozen=True)
class CertificateIssue:
    """Why a host has no usable certificate: a condition reason and a message for people."""

    reason: str
    message: str


@dataclass(frozen=True)
class ExposeState:
    """One ``status.exposes`` entry."""

    name: str
    status: Status
    reason: str
    message: str
    listening: bool | None = None
    reachable: bool | None = None
    hosts: list[JSON] = field(default_factory=list)

    def entry(self) -> JSON:
        out: JSON = {"name": self.name, "ready": self.status == "True", "message": self.message[:1024]}
        if self.status != "True":
            out["reason"] = self.reason
        if self.listening is not None:
            out["listening"] = self.listening
        if self.reachable is not None:
            out["backendReachable"] = self.reachable
        if self.hosts:
            out["hosts"] = self.hosts
        return out


@dataclass(frozen=True)
class Report:
    """Status fields (besides ``preAuthKey``) and conditions (besides TagOwned, PreAuthKeyValid)."""

    fields: JSON
    conditions: list[Cond]


_EPOCH = datetime.min.replace(tzinfo=UTC)


def _age(node: Node) -> tuple[datetime, int]:
    """Registration order: creation time, then the id (Headscale's ids only grow)."""
    return node.created_at or _EPOCH, int(node.id) if node.id.isdigit() else 0


class KeyIds(Protocol):
    """The ids of a CR's pre-auth keys as its record holds them (an :class:`AuthKey`)."""

    @property
    def id(self) -> str: ...

    @property
    def previous_id(self) -> str: ...

    @property
    def node_ids(self) -> frozenset[str]: ...


def own_nodes(key: KeyIds, nodes: Sequence[Node]) -> list[Node]:
    """The nodes registered with the ingress's current or previous pre-auth key, or recorded as its
    own (registered with a key since retired)."""
    ids = {key.id, key.previous_id} - {""}
    return [n for n in nodes if n.pre_auth_key_id in ids or n.id in key.node_ids]


@dataclass(frozen=True)
class Succession:
    """What the status phase tidies among an ingress's own nodes so that its newest online one
    holds ``spec.hostname``: the ``superseded`` ones (older and offline: a pod that crashed, or was
    stopped without logging out) are deleted, the ``retiring`` ones (older and online: the old pod
    of a rollout, draining) give the name up and take :func:`retired_name`, then the ``newest`` is
    renamed to ``spec.hostname`` when ``rename``."""

    newest: Node
    superseded: tuple[Node, ...]
    retiring: tuple[Node, ...]
    rename: bool


def retired_name(hostname: str, node: Node) -> str:
    """The name an online node hands its hostname over under: unique by the node's id, and a DNS
    label of at most 63 characters."""
    suffix = f"-old{node.id}"
    return f"{hostname[:63 - len(suffix)].rstrip('-')}{suffix}"


def rollout_done(deployment: JSON | None) -> bool:
    """Whether the agent Deployment's current pods are all ready and no pod of an older template is
    still counted: then the newest node is a ready pod's, and an older one still online is a pod
    that is terminating (draining). Read from the Deployment's status as stored."""
    if not deployment:
        return False
    meta, spec, status = deployment.get("metadata") or {}, deployment.get("spec") or {}, deployment.get("status") or {}
    wanted = int(spec.get("replicas", 1))
    counts = [int(status.get(field) or 0) for field in ("replicas", "updatedReplicas", "readyReplicas")]
    current = int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
    return current and wanted > 0 and counts == [wanted] * 3


def succession(hostname: str, key: KeyIds, nodes: Sequence[Node], *, rolled_out: bool,
               replicas: int = 1) -> Succession | None:
    """What to do so that the ingress's newest online node holds ``hostname`` (None: nothing).

    The name moves without a gap: an older node that still holds it while online (the old pod of a
    rollout) keeps it until the rollout is done (``rolled_out``: the new pod is ready, the old one
    terminating), then hands it over and keeps serving under :func:`retired_name` while it drains,
    so a client that resolved the name before the hand-over still reaches it. A name held by no
    online node moves as soon as the newest is online. A name held by a node that is not the
    ingress's is reported (``HostnameTaken``), never taken.

    With ``replicas`` above 1 (replicas behind a shared address) the newest ``replicas`` nodes are
    the replicas' own and are never superseded: one that is offline for a moment (its control
    connection re-made, Headscale restarted) comes back as it was."""
    own = own_nodes(key, nodes)
    online = [n for n in own if n.online]
    if not online:
        return None
    newest = max(online, key=_age)
    replicas_own = {n.id for n in sorted(own, key=_age)[-replicas:]} if replicas > 1 else set()
    superseded = tuple(sorted((n for n in own if not n.online and n.id not in replicas_own
                               and (_age(n) < _age(newest) or n.given_name == hostname)), key=_age))
    holders = [n for n in nodes if n.given_name == hostname and n.id != newest.id]
    if any(n not in own for n in holders):
        return Succession(newest, superseded, (), False) if superseded else None
    retiring = tuple(n for n in holders if n.online)
    rename = newest.given_name != hostname and (rolled_out or not retiring)
    if not rename:
        retiring = ()
    if not superseded and not rename:
        return None
    return Succession(newest, superseded, retiring, rename)


def ingress_node(key: AuthKey, agent: JSON | None, nodes: list[Node]) -> JSON | None:
    """The agent's node as Headscale records it: the node registered with the ingress's current
    (or previous) pre-auth key, online and newest first. Never from the agent's own /status: any
    pod the tenant runs with the agent's labels answers that, so its addresses prove nothing. The
    agent's MagicDNS name is taken only when it reports that same node."""
    candidates = own_nodes(key, nodes)
    if not candidates:
        return None
    best = max(candidates, key=lambda n: (n.online, *_age(n)))
    node: JSON = {"id": best.id, "name": best.given_name, "addresses": list(best.ip_addresses)}
    reported = node_status(agent)
    if (reported is not None and reported["id"] == best.id
            and reported["name"].split(".", 1)[0] == best.given_name and "." in reported["name"]):
        node["name"] = reported["name"]
    return node


def _host_issue(ingress: TailnetIngress, host: VirtualHost, reader: Reader,
                issues: dict[str, CertificateIssue]) -> CertificateIssue | None:
    if (issue := issues.get(host.name)) is not None:
        return issue
    secret_name = build.host_secret_name(ingress, host)
    secret = reader.get(SECRET, secret_name, ingress.metadata.namespace)
    if secret is None:
        if host.tls is not None and host.tls.cert_manager is not None:
            return CertificateIssue("CertificatePending", (
                f"{host.name}: waiting for cert-manager to issue the Certificate "
                f"{build.certificate_name(ingress, host)} into the Secret {secret_name} (kubectl describe "
                f"certificate {build.certificate_name(ingress, host)} says why it has not)"))
        return CertificateIssue("SecretMissing", f"{host.name}: the Secret {secret_name} (tls.secretName) does "
                                                 "not exist in this namespace")
    data = secret.get("data") or {}
    if not data.get("tls.crt") or not data.get("tls.key"):
        return CertificateIssue("SecretInvalid", f"{host.name}: the Secret {secret_name} has no tls.crt and "
                                                 "tls.key (a kubernetes.io/tls Secret is needed)")
    return None


def _certificate_conditions(ingress: TailnetIngress, reader: Reader,
                            issues: dict[str, CertificateIssue]) -> Cond:
    hosts = build.tls_hosts(ingress)
    if not hosts:
        return Cond("CertificatesReady", "True", "NotNeeded", "no TLS http expose: no certificate is needed")
    found = [i for h in hosts if (i := _host_issue(ingress, h, reader, issues)) is not None]
    if not found:
        return Cond("CertificatesReady", "True", "Present",
                    f"the TLS Secret of each of the {len(hosts)} host(s) is present")
    return Cond("CertificatesReady", "False", found[0].reason, "; ".join(i.message for i in found))


def _agent_entry(agent: JSON | None, name: str) -> JSON | None:
    for entry in (agent or {}).get("exposes") or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry
    return None


def _agent_host(entry: JSON | None, name: str) -> JSON:
    for host in (entry or {}).get("hosts") or []:
        if isinstance(host, dict) and str(host.get("name") or "").lower() == name.lower():
            return host
    return {}


def _hosts(ingress: TailnetIngress, expose: Expose, zones: list[str], entry: JSON | None) -> list[JSON]:
    out = []
    for host in expose.hosts or []:
        item: JSON = {"name": host.name}
        if host.tls is not None:
            item["secretName"] = build.host_secret_name(ingress, host)
        if host.alias:
            item["alias"] = host.alias
            if names := build.alias_names(host, zones):
                item["aliasNames"] = names
        if not_after := _agent_host(entry, host.name).get("notAfter"):
            item["certificateNotAfter"] = str(not_after)
        out.append(item)
    return out


def expose_state(ingress: TailnetIngress, expose: Expose, zones: list[str], agent: JSON | None) -> ExposeState:
    """One expose as the agent sees it (Unknown when its /status could not be read)."""
    entry = _agent_entry(agent, expose.name)
    hosts = _hosts(ingress, expose, zones, entry)
    if entry is None:
        why = "the agent does not list the expose yet" if agent is not None else \
            "the agent's /status could not be read"
        return ExposeState(expose.name, "Unknown", "AgentStatusUnknown", why, hosts=hosts)
    listening = bool(entry.get("listening"))
    reachable: Any = entry.get("reachable")
    reachable = reachable if isinstance(reachable, bool) else None
    backend = f"{build.backend_host(ingress, expose)}:{expose.backend.port}"
    if not listening:
        return ExposeState(expose.name, "False", "NotListening",
                           f"port {expose.port} is not listening: {entry.get('message') or 'no reason given'}",
                           listening, reachable, hosts)
    broken = [f"{h.get('name')}: {h['error']}" for h in (entry.get("hosts") or [])
              if isinstance(h, dict) and h.get("error")]
    if broken:
        return ExposeState(expose.name, "False", "CertificateError",
                           f"the agent cannot load a certificate: {'; '.join(broken)}", listening, reachable, hosts)
    if reachable is False:
        return ExposeState(expose.name, "False", "BackendUnreachable",
                           f"listening on {expose.port}, but {backend} did not answer the agent's probe: "
                           f"{entry.get('backendError') or 'no reason given'}", listening, reachable, hosts)
    probed = "answers" if reachable else "has not been probed yet"
    return ExposeState(expose.name, "True", "Listening", f"listening on {expose.port}; {backend} {probed}",
                       listening, reachable, hosts)


def _exposes_condition(states: list[ExposeState]) -> Cond:
    bad = [s for s in states if s.status != "True"]
    if not bad:
        return Cond("ExposesReady", "True", "Listening", f"all {len(states)} expose(s) are listening")
    message = "; ".join(f"{s.name}: {s.message}" for s in bad)
    status: Status = "Unknown" if all(s.status == "Unknown" for s in bad) else "False"
    first = next(s for s in bad if s.status == status)
    return Cond("ExposesReady", status, first.reason, message)


def _ready(certificates: Cond, exposes: Cond) -> Cond:
    for cond in (certificates, exposes):
        if cond.status != "True":
            return Cond("Ready", cond.status, cond.reason, cond.message)
    return Cond("Ready", "True", "Ready", f"{exposes.message}; {certificates.message}")


def report(ingress: TailnetIngress, zones: list[str], *, agent: JSON | None, nodes: list[Node], key: AuthKey,
           reader: Reader, issues: dict[str, CertificateIssue], dns: bool) -> Report:
    """Status fields and conditions of one ingress. ``dns``: the Tailnet owns a hosts file."""
    states = [expose_state(ingress, e, zones, agent) for e in ingress.spec.exposes]
    fields: JSON = {"exposes": [s.entry() for s in states]}
    if node := ingress_node(key, agent, nodes):
        fields["node"] = node
        if "." in node["name"]:
            fields["magicDNSName"] = node["name"]
    if dns and (names := build.dns_names(ingress, zones)):
        fields["dnsNames"] = names
    certificates = _certificate_conditions(ingress, reader, issues)
    exposes = _exposes_condition(states)
    conditions = [certificates, exposes, _ready(certificates, exposes)]
    if node is not None:
        conditions.append(hostname_condition(ingress.spec.hostname, node, nodes))
    if ingress.spec.shared_address is not None:
        conditions.append(shared_address_condition(ingress.spec.shared_address, own_nodes(key, nodes)))
    return Report(fields, conditions)


def shared_address_condition(address: str, own: Sequence[Node]) -> Cond:
    """SharedAddressServed: which of the ingress's nodes Headscale sends the shared address to (the
    primary of its route), and how many of them advertise it. Not part of Ready: the address moves
    between replicas during a rollout, and a moment between two primaries is no failure."""
    route = host_route(address)
    online = [n for n in own if n.online]
    advertising = [n for n in online if route in n.available_routes]
    primary = [n for n in own if route in n.subnet_routes]
    if primary:
        served = primary[0]
        return Cond("SharedAddressServed", "True", "Served", (
            f"{address} is served by node {served.id} ({served.given_name}); {len(advertising)} of the "
            f"ingress's {len(online)} online node(s) advertise it"))
    if not advertising:
        return Cond("SharedAddressServed", "False", "NotAdvertised", (
            f"none of the ingress's {len(online)} online node(s) advertises {route} yet (its agents do once "
            "registered)"))
    approved = [n for n in advertising if route in n.approved_routes]
    if not approved:
        return Cond("SharedAddressServed", "False", "NotApproved", (
            f"{len(advertising)} node(s) advertise {route} but Headscale approved it for none: the rendered "
            "policy approves it for the ingress's tag (autoApprovers.routes); with Tailnet spec.policy in "
            "Render mode apply that policy, or approve the route (headscale nodes approve-routes)"))
    return Cond("SharedAddressServed", "False", "NoPrimary", (
        f"{len(approved)} node(s) advertise {route} with approval, but Headscale names no primary for it yet"))


def hostname_condition(hostname: str, node: JSON, nodes: list[Node]) -> Cond:
    """HostnameAssigned: whether the node got ``spec.hostname`` as its tailnet name. Headscale gives a
    node whose hostname another node holds a suffixed name instead, so the MagicDNS name is not the
    one people were told (the DNS names of ``dnsTemplate`` still point at the node)."""
    given = str(node.get("name") or "").split(".", 1)[0]
    if not given or given == hostname:
        return Cond("HostnameAssigned", "True", "Assigned", f"the node's tailnet name is {hostname}")
    holders = [f"{n.given_name} (node {n.id}{', online' if n.online else ', offline'}"
               f"{', tags ' + ','.join(n.tags) if n.tags else ''})"
               for n in nodes if n.given_name == hostname and str(n.id) != str(node.get("id"))]
    held = f"another node holds it: {'; '.join(holders)}" if holders else "another node held it at registration"
    return Cond("HostnameAssigned", "False", "HostnameTaken",
                f"the hostname {hostname} is taken on the tailnet ({held}), so Headscale named this node {given}. "
                "If that node is this ingress's previous node, the operator deletes it once it is offline and "
                "renames this one to the hostname (Events SupersededNodeDeleted, NodeRenamed); "
                "otherwise rename or remove that node, or choose another spec.hostname")
