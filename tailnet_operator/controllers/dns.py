"""The DNS reconciler: one CoreDNS hosts file per Tailnet, from its egress aliases and ingress names.

Each alias of an egress target (a real host name consumers dial, for far ends that route by SNI
or Host) points at the ClusterIP of the target's Service. Each name of a TailnetIngress (its
``dnsTemplate`` name, each host's name and the host's alias under every zone of the Tailnet)
points at the ingress node's tailnet address (its IPv4 one), from the ingress's
``status.node``; an egress alias wins over an ingress name that is the same. The file is the ConfigMap
``spec.dns.hostsConfigMap`` (key ``hosts``), which the cluster's CoreDNS serves with its
``hosts`` plugin; the resolver stays the cluster's, so if the operator dies the last file keeps
answering.

The file is rendered deterministically (sorted, no timestamps), so an unchanged world writes
nothing, and a ConfigMap update is atomic, so readers never see half a file. An alias whose
Service cannot be read right now (not created yet, no ClusterIP yet, the cache not caught up),
or an ingress whose node has no address yet, keeps the address the current file gives it: a
failed read never empties the file. A deleted CR's names leave the file.
"""

from __future__ import annotations

import ipaddress

import structlog
from pydantic import ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.resources import ingress as ingress_build
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime import CONFIG_MAP, SERVICE, Reader, Request, Result, Writer
from tailnet_operator.types import JSON

from .access import live_tailnet
from .kinds import TAILNET_EGRESS, TAILNET_INGRESS
from .policy import TAILNET_INDEX

__all__ = ["FIELD_MANAGER", "HOSTS_KEY", "DnsReconciler", "in_zone", "parse_hosts", "render_hosts"]

log = structlog.get_logger("controllers.dns")

FIELD_MANAGER = "tailnet-operator-dns"
HOSTS_KEY = "hosts"
HEADER = ("# Managed by tailnet-operator (DNS reconciler): egress aliases -> their target Service's ClusterIP,\n"
          "# ingress names -> the ingress node's tailnet address.\n")


def render_hosts(entries: dict[str, str]) -> str:
    """The hosts file for ``{name: address}``: one line per name, sorted, stable for equal input."""
    return HEADER + "".join(f"{address} {name}\n" for name, address in sorted(entries.items()))


def in_zone(name: str, zone: str) -> bool:
    """Whether ``name`` is ``zone`` or under it (case and a trailing dot ignored)."""
    name, zone = name.lower().rstrip("."), zone.lower().rstrip(".")
    return name == zone or name.endswith("." + zone)


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

    def __init__(self, reader: Reader, writer: Writer, *, namespace: str) -> None:
        self.reader = reader
        self.writer = writer
        self.namespace = namespace

    async def reconcile(self, request: Request) -> Result:
        live = live_tailnet(self.reader, request.name)
        dns = live.tailnet.spec.dns if live is not None else None
        if live is None or dns is None:
            return Result()
        obj = live.obj
        ref = dns.hosts_config_map
        current = self.reader.get(CONFIG_MAP, ref.name, ref.namespace)
        previous = parse_hosts(((current or {}).get("data") or {}).get(HOSTS_KEY, ""))
        # Egress aliases outside the zones are left out (the egress reports them: AliasesServed).
        entries = {name: address for name, address in self._entries(request.name, previous).items()
                   if any(in_zone(name, str(zone)) for zone in dns.zones)}
        for name, address in self._ingress_entries(live.tailnet, previous).items():
            entries.setdefault(name, address)
        await self.writer.apply(CONFIG_MAP, {
            "metadata": owned_metadata(obj, name=ref.name, namespace=ref.namespace, tailnet=request.name),
            "data": {HOSTS_KEY: render_hosts(entries)},
        }, field_manager=FIELD_MANAGER)
        return Result()

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
        zones = [str(z) for z in tailnet.spec.dns.zones] if tailnet.spec.dns else []
        entries: dict[str, str] = {}
        for obj in self.reader.list(TAILNET_INGRESS, index=(TAILNET_INDEX, str(tailnet.metadata.name))):
            if obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                ingress = TailnetIngress.model_validate(obj)
            except ValidationError:
                log.warning("skipping an ingress that does not parse", name=obj["metadata"].get("name"))
                continue
            address = node_address(obj)
            for name in ingress_build.dns_names(ingress, zones):
                if address:
                    entries[name] = address
                elif name in previous:
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


def node_address(ingress: JSON) -> str:
    """The ingress node's tailnet address from its status: the IPv4 one, else the first ("" if none)."""
    addresses = [str(a) for a in (((ingress.get("status") or {}).get("node") or {}).get("addresses") or [])]
    for address in addresses:
        try:
            if ipaddress.ip_address(address).version == 4:
                return address
        except ValueError:
            continue
    return addresses[0] if addresses else ""


def tailnet_of(obj: JSON) -> list[Request]:
    """A Service the Egress reconciler owns carries its Tailnet's name as a label."""
    name = (obj["metadata"].get("labels") or {}).get("tailnet.dev/tailnet")
    return [Request("", name)] if name else []
