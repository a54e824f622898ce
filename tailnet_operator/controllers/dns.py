"""The DNS reconciler: one CoreDNS hosts file per Tailnet, from its egress aliases and ingress names.

Each alias of an egress target (a real host name consumers dial, for far ends that route by SNI
or Host) points at the ClusterIP of the target's Service. Each name of a TailnetIngress (its
``dnsTemplate`` name, each host's name and the host's alias under every zone of the Tailnet)
points at the ingress node's tailnet address (its IPv4 one), as the Ingress reconciler recorded
it from Headscale in the ingress's record in the operator's namespace (never from anything the
tenant or its pods can write). An ingress's names are written only when its namespace may use
them (:mod:`tailnet_operator.tenancy`), and a name goes to its first holder: an egress alias,
then ingresses by creation time (:func:`name_holders`, which the Ingress reconciler uses to
refuse the later claimant). The file is the ConfigMap
``spec.dns.hostsConfigMap`` (key ``hosts``), which the cluster's CoreDNS serves with its
``hosts`` plugin; the resolver stays the cluster's, so if the operator dies the last file keeps
answering.

The file is rendered deterministically (sorted, no timestamps), so an unchanged world writes
nothing, and a ConfigMap update is atomic, so readers never see half a file. An alias whose
Service cannot be read right now (not created yet, no ClusterIP yet, the cache not caught up),
or an ingress whose node has no address yet, keeps the address the current file gives it: a
failed read never empties the file. A deleted CR's names leave the file.

The Tailnet owns the ConfigMap (it goes with the Tailnet) only when the operator created it; one
someone else created is written but never owned. CoreDNS's own configuration and another
Tailnet's hosts file are refused (:mod:`.hosts_guard`), with a Warning Event
``HostsConfigMapRefused`` on the Tailnet, and nothing is written.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

import structlog
from pydantic import ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.names import TAILNET_LABEL
from tailnet_operator.resources import ingress as ingress_build
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Reader, Request, Result, Writer
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.runtime.events import EventRecorder
from tailnet_operator.tenancy import Claim, claim_order, claimed, first_holders, in_zone, is_address, judge
from tailnet_operator.types import JSON

from . import hosts_guard, periods
from .access import live_tailnet
from .kinds import TAILNET_EGRESS, TAILNET_INGRESS
from .policy import TAILNET_INDEX

__all__ = ["FIELD_MANAGER", "HOSTS_KEY", "DnsReconciler", "in_zone", "name_holders", "parse_hosts", "render_hosts"]

log = structlog.get_logger("controllers.dns")

FIELD_MANAGER = "tailnet-operator-dns"
REFUSED_RETRY_SECONDS = periods.DNS_REFUSED_RETRY
HOSTS_KEY = "hosts"
HEADER = ("# Managed by tailnet-operator (DNS reconciler): egress aliases -> their target Service's ClusterIP,\n"
          "# ingress names -> the ingress node's tailnet address.\n")


def render_hosts(entries: dict[str, str]) -> str:
    """The hosts file for ``{name: address}``: one line per name, sorted, stable for equal input."""
    return HEADER + "".join(f"{address} {name}\n" for name, address in sorted(entries.items()))


def parse_hosts(text: str) -> dict[str, str]:
    """``{name: address}`` of a hosts file (comments and malformed lines skipped)."""
    entries: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        try:
            ipaddress.ip_address(fields[0])
        except ValueError:
            continue
        for name in fields[1:]:
            entries[name.lower()] = fields[0]
    return entries


class DnsReconciler:
    """Reconciles one Tailnet's hosts ConfigMap; ``namespace`` is the operator's (where egresses live)."""

    def __init__(self, reader: Reader, writer: Writer, *, namespace: str, events: EventRecorder | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.namespace = namespace
        self.events = events

    async def reconcile(self, request: Request) -> Result:
        live = live_tailnet(self.reader, request.name)
        dns = live.tailnet.spec.dns if live is not None else None
        if live is None or dns is None:
            return Result()
        obj = live.obj
        ref = dns.hosts_config_map
        current = self.reader.get(CONFIG_MAP, ref.name, ref.namespace)
        if refusal := hosts_guard.refusal(ref.namespace, ref.name, current, obj, self.reader):
            return await self._refused(obj, refusal)
        previous = parse_hosts(((current or {}).get("data") or {}).get(HOSTS_KEY, ""))
        # Egress aliases outside the zones are left out (the egress reports them: AliasesServed).
        entries = {name: address for name, address in self._entries(request.name, previous).items()
                   if any(in_zone(name, str(zone)) for zone in dns.zones)}
        for name, address in self._ingress_entries(live.tailnet, previous).items():
            entries.setdefault(name, address)
        try:
            await self.writer.apply(CONFIG_MAP, {
                "metadata": hosts_guard.metadata(obj, ref.namespace, ref.name, current),
                "data": {HOSTS_KEY: render_hosts(entries)},
            }, field_manager=FIELD_MANAGER)
        except Forbidden as exc:
            return await self._refused(obj, hosts_guard.forbidden_message(ref.namespace, ref.name, exc))
        return Result()

    async def _refused(self, tailnet: JSON, message: str) -> Result:
        log.warning("hosts ConfigMap refused", tailnet=tailnet["metadata"]["name"], reason=message)
        if self.events is not None:
            await self.events.warning(tailnet, "HostsConfigMapRefused", message, action="WriteHostsFile")
        return Result(requeue_after=REFUSED_RETRY_SECONDS)

    def _entries(self, tailnet: str, previous: dict[str, str]) -> dict[str, str]:
        entries: dict[str, str] = {}
        for egress in self._egresses(tailnet):
            for target in egress.spec.targets:
                address = self._cluster_ip(target.name, str(egress.metadata.name))
                for alias in target.aliases or []:
                    name = str(alias).lower().rstrip(".")
                    if address:
                        entries[name] = address
                    elif name in previous:
                        entries[name] = previous[name]  # unreadable now: keep what answers today
        return entries

    def _ingress_entries(self, tailnet: Tailnet, previous: dict[str, str]) -> dict[str, str]:
        entries: dict[str, str] = {}
        holders = name_holders(self.reader, tailnet, self.namespace)
        for name, claim in holders.items():
            if claim.rank[0] == 0 or is_address(name):
                continue  # an egress alias (written above), or a shared address (no name)
            shared = next((n for n in claim.names if is_address(n) and holders.get(n) is claim), None)
            if shared is not None:  # the ingress's replicas share it: its names point there
                entries[name] = shared
                continue
            namespace, ingress = claim.rank[2], claim.rank[3]
            record = self.reader.get(SECRET, ingress_build.record_name(namespace, ingress), self.namespace)
            address = node_address(record)
            if address:
                entries[name] = address
            elif record is not None and name in previous:
                entries[name] = previous[name]  # no address now: keep what answers today
        return entries

    def _egresses(self, tailnet: str) -> list[TailnetEgress]:
        parsed = []
        for obj in self.reader.list(TAILNET_EGRESS, self.namespace, index=(TAILNET_INDEX, tailnet)):
            if obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                parsed.append(TailnetEgress.model_validate(obj))
            except ValidationError:
                log.warning("skipping an egress that does not parse", name=obj["metadata"].get("name"))
        return parsed

    def _cluster_ip(self, service: str, egress: str) -> str:
        """The ClusterIP of the target's Service, if it is this egress's (a name another egress
        holds is a conflict that egress reports; its alias must not lead to the other's target)."""
        svc = self.reader.get(SERVICE, service, self.namespace)
        if ((svc or {}).get("metadata", {}).get("labels") or {}).get("tailnet.dev/egress") != egress:
            return ""
        ip = ((svc or {}).get("spec") or {}).get("clusterIP") or ""
        return "" if ip in ("", "None") else str(ip)


def name_holders(reader: Reader, tailnet: Tailnet, namespace: str, *,
                 reserved: Iterable[str] = ()) -> dict[str, Claim]:
    """Every DNS name of ``tailnet`` with the object that holds it: the aliases of the egresses in
    ``namespace`` (the operator's), then each ingress whose namespace may use its tag and names
    (``reserved``: the tags no prefix grants), first created first."""
    name = str(tailnet.metadata.name)
    zones = [str(z) for z in tailnet.spec.dns.zones] if tailnet.spec.dns else []
    claims = []
    for obj in reader.list(TAILNET_EGRESS, namespace, index=(TAILNET_INDEX, name)):
        if obj["metadata"].get("deletionTimestamp"):
            continue
        aliases = [str(a).lower().rstrip(".") for t in (obj.get("spec") or {}).get("targets") or []
                   for a in t.get("aliases") or []]
        claims.append(Claim(claim_order(obj, egress=True), tuple(aliases)))
    for obj in reader.list(TAILNET_INGRESS, index=(TAILNET_INDEX, name)):
        if obj["metadata"].get("deletionTimestamp"):
            continue
        try:  # parsed once per resourceVersion by the cache: this runs in every ingress's reconcile
            ingress = reader.get(TailnetIngress, obj["metadata"]["name"], obj["metadata"].get("namespace"))
        except ValidationError:
            log.warning("skipping an ingress that does not parse", name=obj["metadata"].get("name"))
            continue
        if ingress is None:
            continue
        names = ingress_build.dns_names(ingress, zones)
        if judge(ingress, tailnet, reserved=reserved, names=names) is None:
            claims.append(Claim(claim_order(obj), claimed(ingress, names)))
    return first_holders(claims)


def node_address(record: JSON | None) -> str:
    """The ingress node's tailnet address from its record: the IPv4 one, else the first ("" if none)."""
    noted = ((record or {}).get("metadata", {}).get("annotations") or {}).get(ingress_build.NODE_ADDRESS_ANNOTATION)
    addresses = [a for a in str(noted or "").split(",") if a]
    for address in addresses:
        try:
            if ipaddress.ip_address(address).version == 4:
                return address
        except ValueError:
            continue
    return addresses[0] if addresses else ""


def tailnet_of(obj: JSON) -> list[Request]:
    """A Service the Egress reconciler owns carries its Tailnet's name as a label."""
    name = (obj["metadata"].get("labels") or {}).get(TAILNET_LABEL)
    return [Request("", name)] if name else []
