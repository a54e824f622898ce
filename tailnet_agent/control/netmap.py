"""The network map: what the control server says about this node, its peers and the tailnet.

Pure: :func:`apply` takes the current :class:`NetMap` (or None) and one decoded MapResponse and
returns the next one. The delta rules follow ``control/controlclient/map.go
updatePeersStateFromResponse`` and ``tailcfg.MapResponse``'s field docs:

* ``KeepAlive``-only messages change nothing;
* ``Node``, ``DERPMap``, ``DNSConfig``, ``Domain``: absent (null) means unchanged;
* a non-empty ``Peers`` replaces every peer; otherwise ``PeersRemoved`` (ids), then
  ``PeersChanged`` (whole nodes by id), then ``OnlineChange``, then ``PeersChangedPatch``
  (patches for unknown ids are ignored);
* ``UserProfiles`` hold new or changed profiles only: they are merged by id, never cleared;
* ``PacketFilter`` (non-null) is the filter named ``"base"``; ``PacketFilters`` maps names to
  rules, a null value deletes that name and the key ``"*"`` with null clears all first.

Only the fields the agent uses are modelled; everything else is ignored.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LEGACY_DERP_PREFIX = "127.3.3.40:"


PARSED_NETWORKS = 1 << 15
"""Addresses and prefixes :func:`_network` keeps parsed, least recently used dropped first: two per
peer (its IPv4 and IPv6 address, which its allowed IPs repeat) for 16,000 peers, or fewer peers
with subnet routes."""


@functools.lru_cache(maxsize=PARSED_NETWORKS)
def _network(value: Any) -> IPNetwork:
    """``value`` parsed once and shared: Headscale 0.29 sends every peer again in the message that
    announces a new node, and parsing the addresses was three quarters of decoding a peer (38 ms
    of a 1,000-peer message, 9 ms with them shared). A node's addresses and allowed IPs are then
    one set of objects."""
    return ipaddress.ip_network(value, strict=False)


def _networks(values: Any) -> tuple[IPNetwork, ...]:
    return tuple(_network(v) for v in values or ())


def _str_tuple(values: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in values or ())


def _home_derp(doc: Mapping[str, Any]) -> int:
    """``HomeDERP``, or the region from the legacy ``"DERP":"127.3.3.40:<region>"`` form."""
    if doc.get("HomeDERP"):
        return int(doc["HomeDERP"])
    legacy = str(doc.get("DERP") or "")
    if legacy.startswith(LEGACY_DERP_PREFIX) and legacy[len(LEGACY_DERP_PREFIX):].isdigit():
        return int(legacy[len(LEGACY_DERP_PREFIX):])
    return 0


@dataclass(frozen=True, kw_only=True)
class Node:
    """A ``tailcfg.Node`` (self or peer)."""

    id: int
    stable_id: str = ""
    name: str = ""
    """MagicDNS FQDN with a trailing dot, e.g. ``agent.tailnet.test.``."""
    key: str = ""
    """``nodekey:<hex>``: the WireGuard public key."""
    disco_key: str = ""
    machine_key: str = ""
    addresses: tuple[IPNetwork, ...] = ()
    allowed_ips: tuple[IPNetwork, ...] | None = None
    """None means the same as ``addresses`` (capver >= 112)."""
    primary_routes: tuple[IPNetwork, ...] = ()
    endpoints: tuple[str, ...] = ()
    home_derp: int = 0
    """DERP region id; 0 means unknown."""
    online: bool | None = None
    tags: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    key_expiry: str = ""
    expired: bool = False
    cap: int = 0
    hostname: str = ""
    user: int = 0
    """``User``: the id of the owning user's profile (Headscale gives tagged nodes its
    tagged-devices user; their identity is their tags)."""

    @property
    def routable_ips(self) -> tuple[IPNetwork, ...]:
        return self.addresses if self.allowed_ips is None else self.allowed_ips

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Node:
        hostinfo = doc.get("Hostinfo") or {}
        caps = list(doc.get("Capabilities") or ()) + [c for c in (doc.get("CapMap") or {}) if c not in
                                                       (doc.get("Capabilities") or ())]
        return cls(
            id=int(doc.get("ID") or 0), stable_id=str(doc.get("StableID") or ""), name=str(doc.get("Name") or ""),
            key=str(doc.get("Key") or ""), disco_key=str(doc.get("DiscoKey") or ""),
            machine_key=str(doc.get("Machine") or ""), addresses=_networks(doc.get("Addresses")),
            allowed_ips=None if doc.get("AllowedIPs") is None else _networks(doc["AllowedIPs"]),
            primary_routes=_networks(doc.get("PrimaryRoutes")), endpoints=_str_tuple(doc.get("Endpoints")),
            home_derp=_home_derp(doc), online=doc.get("Online"), tags=_str_tuple(doc.get("Tags")),
            capabilities=tuple(str(c) for c in caps), key_expiry=str(doc.get("KeyExpiry") or ""),
            expired=bool(doc.get("Expired")), cap=int(doc.get("Cap") or 0),
            hostname=str(hostinfo.get("Hostname") or "") if isinstance(hostinfo, Mapping) else "",
            user=int(doc.get("User") or 0),
        )

    def patched(self, patch: Mapping[str, Any]) -> Node:
        """Apply one ``tailcfg.PeerChange``; only fields present in the patch change."""
        changes: dict[str, Any] = {}
        if patch.get("DERPRegion"):
            changes["home_derp"] = int(patch["DERPRegion"])
        if patch.get("Endpoints") is not None:
            changes["endpoints"] = _str_tuple(patch["Endpoints"])
        if patch.get("Key"):
            changes["key"] = str(patch["Key"])
        if patch.get("DiscoKey"):
            changes["disco_key"] = str(patch["DiscoKey"])
        if patch.get("Online") is not None:
            changes["online"] = bool(patch["Online"])
        if patch.get("KeyExpiry"):
            changes["key_expiry"] = str(patch["KeyExpiry"])
        if patch.get("Cap"):
            changes["cap"] = int(patch["Cap"])
        if patch.get("CapMap") is not None:
            changes["capabilities"] = tuple(str(c) for c in patch["CapMap"])
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class DERPNode:
    name: str
    region_id: int
    host_name: str
    ipv4: str = ""
    ipv6: str = ""
    derp_port: int = 0
    """0 means 443."""
    stun_port: int = 0
    """0 means 3478; -1 disables STUN."""
    stun_only: bool = False
    can_port80: bool = False
    insecure_for_tests: bool = False

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DERPNode:
        return cls(name=str(doc.get("Name") or ""), region_id=int(doc.get("RegionID") or 0),
                   host_name=str(doc.get("HostName") or ""), ipv4=str(doc.get("IPv4") or ""),
                   ipv6=str(doc.get("IPv6") or ""), derp_port=int(doc.get("DERPPort") or 0),
                   stun_port=int(doc.get("STUNPort") or 0), stun_only=bool(doc.get("STUNOnly")),
                   can_port80=bool(doc.get("CanPort80")), insecure_for_tests=bool(doc.get("InsecureForTests")))


@dataclass(frozen=True, kw_only=True)
class DERPRegion:
    region_id: int
    region_code: str = ""
    region_name: str = ""
    avoid: bool = False
    no_measure_no_home: bool = False
    nodes: tuple[DERPNode, ...] = ()

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DERPRegion:
        return cls(region_id=int(doc.get("RegionID") or 0), region_code=str(doc.get("RegionCode") or ""),
                   region_name=str(doc.get("RegionName") or ""), avoid=bool(doc.get("Avoid")),
                   no_measure_no_home=bool(doc.get("NoMeasureNoHome")),
                   nodes=tuple(DERPNode.from_json(n) for n in doc.get("Nodes") or () if n))


@dataclass(frozen=True, kw_only=True)
class DERPMap:
    regions: Mapping[int, DERPRegion] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DERPMap:
        return cls(regions={int(k): DERPRegion.from_json(v) for k, v in (doc.get("Regions") or {}).items() if v})


@dataclass(frozen=True, kw_only=True)
class PortRange:
    ip: str
    """An IP, CIDR, range ``a-b`` or ``*``."""
    first: int
    last: int


@dataclass(frozen=True, kw_only=True)
class FilterRule:
    src_ips: tuple[str, ...]
    dst_ports: tuple[PortRange, ...] = ()
    ip_proto: tuple[int, ...] = ()
    """Empty means TCP, UDP and ICMP."""

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FilterRule:
        ports = tuple(PortRange(ip=str(p.get("IP") or ""), first=int((p.get("Ports") or {}).get("First") or 0),
                                last=int((p.get("Ports") or {}).get("Last") or 0))
                      for p in doc.get("DstPorts") or ())
        return cls(src_ips=_str_tuple(doc.get("SrcIPs")), dst_ports=ports,
                   ip_proto=tuple(int(x) for x in doc.get("IPProto") or ()))


@dataclass(frozen=True, kw_only=True)
class DNSConfig:
    resolvers: tuple[str, ...] = ()
    """Resolver addresses (``dnstype.Resolver.Addr``)."""
    domains: tuple[str, ...] = ()
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    extra_records: Mapping[str, str] = field(default_factory=dict)
    """Name → value of ``ExtraRecords`` (A/AAAA)."""

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DNSConfig:
        def addrs(items: Any) -> tuple[str, ...]:
            return tuple(str(r.get("Addr") or "") for r in items or () if r)
        return cls(resolvers=addrs(doc.get("Resolvers")), domains=_str_tuple(doc.get("Domains")),
                   routes={str(k): addrs(v) for k, v in (doc.get("Routes") or {}).items()},
                   extra_records={str(r.get("Name")): str(r.get("Value")) for r in doc.get("ExtraRecords") or ()})


@dataclass(frozen=True, kw_only=True)
class UserProfile:
    """A ``tailcfg.UserProfile``: who owns nodes (``Node.user`` is its id)."""

    id: int
    login_name: str = ""
    display_name: str = ""

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> UserProfile:
        return cls(id=int(doc.get("ID") or 0), login_name=str(doc.get("LoginName") or ""),
                   display_name=str(doc.get("DisplayName") or ""))


@dataclass(frozen=True, kw_only=True)
class NetMap:
    """One consistent view of the tailnet, as of the last applied MapResponse."""

    self_node: Node
    peers: Mapping[int, Node] = field(default_factory=dict)
    derp_map: DERPMap = field(default_factory=DERPMap)
    packet_filters: Mapping[str, tuple[FilterRule, ...]] = field(default_factory=dict)
    dns: DNSConfig = field(default_factory=DNSConfig)
    domain: str = ""
    user_profiles: Mapping[int, UserProfile] = field(default_factory=dict)
    """By id; each response's ``UserProfiles`` adds to or replaces these (new or changed only)."""

    @property
    def packet_filter(self) -> tuple[FilterRule, ...]:
        """All named filters concatenated in name order."""
        return tuple(rule for name in sorted(self.packet_filters) for rule in self.packet_filters[name])

    def peer_by_address(self, ip: str) -> Node | None:
        """The peer whose own tailnet address ``ip`` is (not one it routes for), if any."""
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return None
        return next((p for p in self.peers.values() if any(
            net.prefixlen == net.max_prefixlen and net.network_address == address for net in p.addresses)), None)


class MalformedMap(ValueError):
    """A MapResponse field does not have the shape ``tailcfg`` gives it (a string where a number
    belongs, an address that does not parse, ...)."""


class IncompleteMap(MalformedMap):
    """The first non-keepalive MapResponse lacked ``Node``."""


def is_keepalive(resp: Mapping[str, Any]) -> bool:
    """True for ``{"KeepAlive":true}`` messages that carry nothing else."""
    return bool(resp.get("KeepAlive")) and all(k == "KeepAlive" for k in resp)


def apply(current: NetMap | None, resp: Mapping[str, Any]) -> NetMap | None:
    """The netmap after ``resp``; None only while no response carried the self node.

    Raises :class:`MalformedMap` (or :class:`IncompleteMap`) for a response it cannot use, and
    nothing else: the response is JSON from the network.
    """
    try:
        return _apply(current, resp)
    except MalformedMap:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError, RecursionError) as exc:
        raise MalformedMap(f"{type(exc).__name__}: {str(exc)[:200]}") from exc


def _apply(current: NetMap | None, resp: Mapping[str, Any]) -> NetMap | None:
    if is_keepalive(resp):
        return current
    node_doc = resp.get("Node")
    if current is None:
        if not node_doc:
            raise IncompleteMap("first MapResponse has no Node")
        base = NetMap(self_node=Node.from_json(node_doc))
    else:
        base = replace(current, self_node=Node.from_json(node_doc)) if node_doc else current
    changes: dict[str, Any] = {"peers": _apply_peers(base.peers, resp)}
    if resp.get("DERPMap") is not None:
        changes["derp_map"] = DERPMap.from_json(resp["DERPMap"])
    if resp.get("DNSConfig") is not None:
        changes["dns"] = DNSConfig.from_json(resp["DNSConfig"])
    if resp.get("Domain"):
        changes["domain"] = str(resp["Domain"])
    if profiles := resp.get("UserProfiles"):
        items = profiles.values() if isinstance(profiles, Mapping) else profiles
        changes["user_profiles"] = {**base.user_profiles,
                                    **{p.id: p for p in (UserProfile.from_json(doc) for doc in items if doc)}}
    filters = _apply_filters(base.packet_filters, resp)
    if filters is not None:
        changes["packet_filters"] = filters
    return replace(base, **changes)


def _apply_peers(peers: Mapping[int, Node], resp: Mapping[str, Any]) -> Mapping[int, Node]:
    if resp.get("Peers"):
        return {node.id: node for node in (Node.from_json(n) for n in resp["Peers"])}
    out = dict(peers)
    for node_id in resp.get("PeersRemoved") or ():
        out.pop(int(node_id), None)
    for doc in resp.get("PeersChanged") or ():
        node = Node.from_json(doc)
        out[node.id] = node
    for node_id, online in (resp.get("OnlineChange") or {}).items():
        if int(node_id) in out:
            out[int(node_id)] = replace(out[int(node_id)], online=bool(online))
    for patch in resp.get("PeersChangedPatch") or ():
        node_id = int(patch.get("NodeID") or 0)
        if node_id in out:
            out[node_id] = out[node_id].patched(patch)
    return out


def _apply_filters(current: Mapping[str, tuple[FilterRule, ...]],
                   resp: Mapping[str, Any]) -> dict[str, tuple[FilterRule, ...]] | None:
    """The new named filters, or None when the response does not touch them."""
    if resp.get("PacketFilter") is None and resp.get("PacketFilters") is None:
        return None
    out = dict(current)
    if resp.get("PacketFilter") is not None:
        out["base"] = tuple(FilterRule.from_json(r) for r in resp["PacketFilter"])
    named: Mapping[str, Any] = resp.get("PacketFilters") or {}
    if "*" in named and named["*"] is None:
        out.clear()
    for name, rules in named.items():
        if name == "*":
            continue
        if rules is None:
            out.pop(name, None)
        else:
            out[name] = tuple(FilterRule.from_json(r) for r in rules)
    return out
