"""What the CRs need from the Headscale policy, as plain values (no CRD models, no I/O).

"The tag is the authorization": every CR is a node with its own tag, so the policy must own the
tag (``tagOwners``), approve the routes its routers advertise (``autoApprovers.routes``) and,
where the CR says what the tag may reach, grant it (``grants``).

Decisions (see the package docstring for the list the docs record):

* Derived tags are owned by ``owners`` (default: nobody, ``[]``). The operator registers agents
  with tag-only pre-auth keys, which Headscale does not check against ``tagOwners``; the entry
  only has to exist so grants and approvers may name the tag. An empty owner list also means no
  person can put the tag on a laptop with ``--advertise-tags``. Owner tags get an entry of their
  own, because Headscale rejects owners that name an undefined tag.
* Site routes are approved for the site's ``router_tag``; the caller passes only sites that are
  not Blocked, so overlap checks stay in the site reconciler.
* Egress targets that are IP addresses get a host route (``/32`` or ``/128``) approved for every
  gateway tag, because a TailnetGateway advertises every egress target. With no gateway there is
  no approval: nobody known advertises the route. DNS-name targets get no approval (the
  operator would have to resolve the name, which is I/O and not stable).
* Each egress gets one grant per target: ``src`` its tag, ``dst`` the address (a DNS name is a
  Headscale host alias and only works if the policy's ``hosts`` defines it), ``ip`` its TCP ports.
* Ingresses contribute only their tag: who may reach an ingress is the policy author's decision
  and nothing in the CR says who that is, so no grant is invented (a wide-open one would be a
  silent security change). An ingress with a shared address also gets that address's host route
  approved for its tag (its replicas advertise it); who may reach the address is again the
  author's grant.
* Gateways contribute their tag and approvals for their own extra routes (the LoadBalancer
  range). Their ``siteRoutes`` are approved through TailnetSites, where overlaps are checked.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailnet_agent.contract.addresses import host_route

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_TAG_OWNERS: tuple[str, ...] = ()
"""Owners of every derived tag unless the caller says otherwise: nobody (see module docstring)."""


# --- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EgressTarget:
    """One off-cluster endpoint of an egress: an IP address or DNS name and its TCP ports."""

    address: str
    ports: tuple[int, ...]


@dataclass(frozen=True)
class EgressInput:
    """A TailnetEgress reduced to what the policy needs."""

    tag: str
    targets: tuple[EgressTarget, ...]
    source: str = field(default="", compare=False)
    """Where it came from, for the marker comment on its entries (e.g. ``TailnetEgress ns/name``)."""


@dataclass(frozen=True)
class IngressInput:
    """A TailnetIngress reduced to what the policy needs (ports are kept for reports only)."""

    tag: str
    ports: tuple[int, ...] = ()
    shared_address: str | None = None
    """The address its replicas share: its host route is approved for the tag."""
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class SiteInput:
    """An unblocked TailnetSite: routes its routers (carrying ``router_tag``) may advertise."""

    name: str
    router_tag: str
    routes: tuple[str, ...]
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class GatewayInput:
    """A TailnetGateway: its router tag and the routes approved for it directly."""

    tag: str
    routes: tuple[str, ...] = ()
    source: str = field(default="", compare=False)


# --- outputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TagOwner:
    """A ``tagOwners`` entry."""

    tag: str
    owners: tuple[str, ...]


@dataclass(frozen=True)
class RouteApproval:
    """An ``autoApprovers.routes`` entry: the route and who may have it approved automatically."""

    route: str
    approvers: tuple[str, ...]


@dataclass(frozen=True)
class Grant:
    """A ``grants`` entry; ``dst`` holds exactly one address or host alias for derived grants."""

    src: tuple[str, ...]
    dst: tuple[str, ...]
    ip: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"src": list(self.src), "dst": list(self.dst), "ip": list(self.ip)}


@dataclass(frozen=True)
class Derived:
    """Everything the CRs need from the policy, each part sorted so renders are deterministic."""

    tag_owners: tuple[TagOwner, ...] = ()
    routes: tuple[RouteApproval, ...] = ()
    grants: tuple[Grant, ...] = ()
    origins: Mapping[tuple[str, ...], set[str]] = field(default_factory=dict, compare=False, hash=False)
    """The inputs each entry came from, by :func:`source_key` (only inputs that named a source).
    Not part of equality: two derivations that need the same entries are the same."""

    def sources(self, entry: TagOwner | RouteApproval | Grant) -> tuple[str, ...]:
        """The sorted sources of ``entry`` (e.g. ``("TailnetEgress ns/a",)``); () if none is known."""
        return tuple(sorted(self.origins.get(source_key(entry), ())))

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(owner.tag for owner in self.tag_owners)


def source_key(entry: TagOwner | RouteApproval | Grant) -> tuple[str, ...]:
    """The key of ``entry`` in :attr:`Derived.origins`."""
    if isinstance(entry, TagOwner):
        return ("tag", entry.tag)
    if isinstance(entry, RouteApproval):
        return ("route", entry.route)
    return ("grant", *entry.src, *entry.dst)


# --- derivation ------------------------------------------------------------------------------


PARSE_CACHE_SIZE = 1 << 16
"""Addresses and networks remembered parsed (ipaddress parses in pure Python)."""


def check_tag(tag: str) -> str:
    """Headscale's own rule (grpcv1 validateTag): ``tag:`` prefix, lower case, no spaces."""
    if not tag.startswith("tag:") or len(tag) == len("tag:") or tag != tag.lower() or any(c.isspace() for c in tag):
        raise ValueError(f"{tag!r} is not a tag: it must start with 'tag:' and be lower case without spaces")
    return tag


def _check_owner(owner: str) -> str:
    if owner.startswith("tag:"):
        return check_tag(owner)
    if owner.startswith("group:") or "@" in owner:
        return owner
    raise ValueError(f"{owner!r} cannot own a tag: use a user (name@), a group:... or a tag:...")


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def route_key(route: str) -> tuple[int, int, int]:
    """Sort key for CIDRs: IPv4 before IPv6, then by address, wider prefixes first."""
    network = ipaddress.ip_network(route)
    return (network.version, int(network.network_address), network.prefixlen)


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _network(route: str) -> str:
    try:
        network = ipaddress.ip_network(route, strict=True)
    except ValueError as exc:
        raise ValueError(f"{route!r} is not a CIDR without host bits: {exc}") from exc
    return str(network)


def _check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535")
    return port


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def parse_address(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``address`` spells, or None for a DNS name (memoized: the same few
    thousand addresses come back on every render)."""
    try:
        return ipaddress.ip_address(address)
    except ValueError:
        return None


def derive(
    *,
    egresses: Iterable[EgressInput] = (),
    ingresses: Iterable[IngressInput] = (),
    sites: Iterable[SiteInput] = (),
    gateways: Iterable[GatewayInput] = (),
    owners: Sequence[str] = DEFAULT_TAG_OWNERS,
) -> Derived:
    """The policy entries the CRs need; input order does not matter (outputs are sorted).

    Raises ValueError for an input no valid CR can produce (bad tag, CIDR or port).
    """
    owner_list = tuple(dict.fromkeys(_check_owner(o) for o in owners))
    egress_list, ingress_list = list(egresses), list(ingresses)
    site_list, gateway_list = list(sites), list(gateways)

    tags: set[str] = set()
    approvers: defaultdict[str, set[str]] = defaultdict(set)
    grant_ports: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    origins: defaultdict[tuple[str, ...], set[str]] = defaultdict(set)

    gateway_tags = {check_tag(g.tag) for g in gateway_list}
    tags |= gateway_tags
    for gateway in gateway_list:
        if gateway.source:
            origins["tag", gateway.tag].add(gateway.source)
        for route in gateway.routes:
            approvers[_network(route)].add(gateway.tag)
            if gateway.source:
                origins["route", _network(route)].add(gateway.source)
    for site in site_list:
        tags.add(check_tag(site.router_tag))
        if site.source:
            origins["tag", site.router_tag].add(site.source)
        for route in site.routes:
            approvers[_network(route)].add(site.router_tag)
            if site.source:
                origins["route", _network(route)].add(site.source)
    for ingress in ingress_list:
        tags.add(check_tag(ingress.tag))
        if ingress.source:
            origins["tag", ingress.tag].add(ingress.source)
        if ingress.shared_address is not None:
            route = host_route(ingress.shared_address)
            approvers[route].add(ingress.tag)
            if ingress.source:
                origins["route", route].add(ingress.source)
    for egress in egress_list:
        tags.add(check_tag(egress.tag))
        if egress.source:
            origins["tag", egress.tag].add(egress.source)
        for target in egress.targets:
            ip = parse_address(target.address)
            dst = str(ip) if ip is not None else target.address.lower().rstrip(".")
            grant_ports[(egress.tag, dst)].update(_check_port(p) for p in target.ports)
            if egress.source:
                origins["grant", egress.tag, dst].add(egress.source)
            if ip is not None and gateway_tags:
                route = f"{ip}/{ip.max_prefixlen}"
                approvers[route].update(gateway_tags)
                if egress.source:
                    origins["route", route].add(egress.source)

    owner_tags = {o for o in owner_list if o.startswith("tag:")} - tags
    # A tag never owns itself: Headscale drops the cycle anyway, and the entry reads as a mistake.
    tag_owners = [TagOwner(tag, tuple(o for o in owner_list if o != tag)) for tag in tags]
    tag_owners += [TagOwner(tag, ()) for tag in owner_tags]
    return Derived(
        tag_owners=tuple(sorted(tag_owners, key=lambda t: t.tag)),
        routes=tuple(
            RouteApproval(route, tuple(sorted(approvers[route]))) for route in sorted(approvers, key=route_key)
        ),
        grants=tuple(
            Grant(src=(tag,), dst=(dst,), ip=tuple(f"tcp:{p}" for p in sorted(ports)))
            for (tag, dst), ports in sorted(grant_ports.items())
            if ports
        ),
        origins=origins,
    )
