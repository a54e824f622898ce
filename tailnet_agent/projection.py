"""The pure projection of a netmap onto the node: data plane input (addresses, peers with their
routes and home region, packet filter), disco's peers, the home DERP region, MagicDNS names.

No I/O: a :class:`~tailnet_agent.control.NetMap` in, plain values out; the one piece of state,
:class:`PeerProjection`, remembers the last projection so that a netmap re-projects only the peers
it changed and the data plane and disco get only what differs. Routing
follows ``routemanager.peerViewOf``: a peer's own addresses are always routable; its other
AllowedIPs (subnet routes Headscale puts there for the primary router) only with accept-routes;
exit routes (``0.0.0.0/0``, ``::/0``) never, since this node does not select an exit node. Peers
that are expired, or have neither a disco key nor a home DERP region, are left out.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from tailnet_agent import _native as nat
from tailnet_agent.control import NetMap
from tailnet_agent.control import netmap as nm
from tailnet_agent.disco import DiscoPeer

log = structlog.get_logger("agent.node")

EXIT_ROUTES = frozenset({ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")})


def self_addresses(netmap: NetMap) -> list[str]:
    """The node's own addresses for ``set_self``: the first IPv4 and the first IPv6 host address."""
    out: list[str] = []
    for version in (4, 6):
        for net in netmap.self_node.addresses:
            if net.version == version:
                out.append(f"{net.network_address}/{net.max_prefixlen}")
                break
    return out


def peer_routes(peer: nm.Node, *, accept_routes: bool) -> list[nm.IPNetwork]:
    """What the node may send to ``peer``: its own addresses, plus its subnet routes with accept-routes.

    Subnet routes are the AllowedIPs beyond the peer's addresses (Headscale puts a router's primary
    routes there); exit routes are always left out.
    """
    own = set(peer.addresses)
    out: list[nm.IPNetwork] = []
    for net in peer.routable_ips:
        if net in EXIT_ROUTES or net in out:
            continue
        is_self = net in own or net.prefixlen == net.max_prefixlen
        if is_self or accept_routes:
            out.append(net)
    return out


def peer_spec(peer: nm.Node, *, accept_routes: bool, fallback_region: int) -> nat.PeerSpec | None:
    """One peer's ``set_peers`` entry (raw node key, AllowedIPs, home region; ``fallback_region``
    if unknown); None for a peer the data plane does not get."""
    if peer.expired or not peer.key.startswith("nodekey:"):
        return None
    if not peer.disco_key and not peer.home_derp:
        return None
    try:
        key = bytes.fromhex(peer.key.removeprefix("nodekey:"))
    except ValueError:
        log.warning("peer with a malformed node key skipped", peer=peer.name or peer.id)
        return None
    if len(key) != 32:
        return None
    routes = [str(net) for net in peer_routes(peer, accept_routes=accept_routes)]
    return key, routes, peer.home_derp or fallback_region


def peer_specs(netmap: NetMap, *, accept_routes: bool, fallback_region: int) -> list[nat.PeerSpec]:
    """``set_peers`` input, in node id order (a prefix two peers claim routes to the first)."""
    specs = (peer_spec(peer, accept_routes=accept_routes, fallback_region=fallback_region)
             for peer in sorted(netmap.peers.values(), key=lambda p: p.id))
    return [spec for spec in specs if spec is not None]


def filter_rules(netmap: NetMap) -> list[nat.FilterRule]:
    """The netmap's packet filter in the data plane's rule shape (``cap:`` sources pass through;
    the data plane ignores them)."""
    return [(list(rule.src_ips), [(p.ip, p.first, p.last) for p in rule.dst_ports], list(rule.ip_proto))
            for rule in netmap.packet_filter]


def disco_peer(peer: nm.Node, *, fallback_region: int, ipv6: bool = False) -> DiscoPeer | None:
    """Disco's view of one peer: raw node and disco keys, ``ip:port`` endpoints (IPv4, and
    ``[ip]:port`` IPv6 ones with ``ipv6``: the node's UDP socket is dual-stack), home region;
    None for a peer disco does not get."""
    if peer.expired or not peer.key.startswith("nodekey:") or not peer.disco_key.startswith("discokey:"):
        return None
    try:
        node_key = bytes.fromhex(peer.key.removeprefix("nodekey:"))
        disco_key = bytes.fromhex(peer.disco_key.removeprefix("discokey:"))
    except ValueError:
        return None
    endpoints = []
    for text in peer.endpoints:
        host, _, port = text.rpartition(":")
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
            # A link-local address names an interface of the peer's machine: not one to send to.
            if (ip.version == 4 or (ipv6 and not ip.is_link_local)) and 0 < int(port) < 65536:
                endpoints.append((str(ip), int(port)))
    return DiscoPeer(node_key, disco_key, tuple(endpoints), peer.home_derp or fallback_region)


def disco_peers(netmap: NetMap, *, fallback_region: int, ipv6: bool = False) -> list[DiscoPeer]:
    """Disco's view of every peer (:func:`disco_peer`)."""
    peers = (disco_peer(peer, fallback_region=fallback_region, ipv6=ipv6) for peer in netmap.peers.values())
    return [peer for peer in peers if peer is not None]


@dataclass(frozen=True)
class PeerChanges:
    """What one netmap changed in the peers' projection: the data plane's and disco's updates."""

    upserts: list[tuple[int, nat.PeerSpec]] = field(default_factory=list)
    """``(node id, spec)`` for ``upsert_peers``: the id ranks peers as ``peer_specs`` orders them."""
    removals: list[bytes] = field(default_factory=list)
    """Node keys for ``remove_peers``."""
    disco_upserts: list[DiscoPeer] = field(default_factory=list)
    disco_removals: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class _Projected:
    node: nm.Node
    spec: nat.PeerSpec | None
    disco: DiscoPeer | None


class PeerProjection:
    """The peers' projection kept from one netmap to the next, so that a netmap costs what it changed.

    A netmap keeps the very ``Node`` object of every peer a message did not touch
    (:func:`tailnet_agent.control.netmap.apply`), and a ``Node`` is frozen: a peer whose object is
    the one projected last time projects to the same spec and disco peer. Of the others, those
    whose projected fields are equal (a peer resent as it was) keep their projection; the rest are
    projected again, and only results that differ are reported. What the data plane and disco hold
    after applying every update equals :func:`peer_specs` and :func:`disco_peers` of the netmap
    (peers are keyed by node key there; two peers with one node key are not modelled). A change of
    the projection's own inputs (accept-routes, fallback region, IPv6) projects every peer again.
    """

    def __init__(self) -> None:
        self._params: tuple[bool, int, bool] | None = None
        self._held: dict[int, _Projected] = {}
        self._specs: dict[bytes, tuple[int, nat.PeerSpec]] = {}
        """What the data plane holds: node key -> (node id, spec)."""
        self._disco: dict[bytes, tuple[int, DiscoPeer]] = {}
        """What disco holds: node key -> (node id, disco peer)."""

    def disco_peers(self) -> list[DiscoPeer]:
        """Every peer disco holds (for a new :class:`~tailnet_agent.disco.Disco`)."""
        return [peer for _, peer in self._disco.values()]

    def update(self, peers: Mapping[int, nm.Node], *, accept_routes: bool, fallback_region: int,
               ipv6: bool) -> PeerChanges:
        """Project the peers whose ``Node`` changed since the last call; what to send where."""
        params = (accept_routes, fallback_region, ipv6)
        everyone = params != self._params
        changed = self._changed_ids(peers, everyone=everyone)
        self._params = params
        specs_before: dict[bytes, tuple[int, nat.PeerSpec] | None] = {}
        disco_before: dict[bytes, tuple[int, DiscoPeer] | None] = {}
        for pid in changed:
            old = self._held.pop(pid, None)
            node = peers.get(pid)
            if old is not None and node is not None and not everyone and _inputs(old.node) == _inputs(node):
                self._held[pid] = _Projected(node, old.spec, old.disco)  # resent as it was
                continue
            new = None if node is None else _Projected(
                node, peer_spec(node, accept_routes=accept_routes, fallback_region=fallback_region),
                disco_peer(node, fallback_region=fallback_region, ipv6=ipv6))
            if new is not None:
                self._held[pid] = new
            _replace(self._specs, specs_before, pid, None if old is None else old.spec,
                     None if new is None else new.spec)
            _replace(self._disco, disco_before, pid, None if old is None else old.disco,
                     None if new is None else new.disco)
        upserts, removals = _diff(self._specs, specs_before)
        disco_upserts, disco_removals = _diff(self._disco, disco_before)
        return PeerChanges(upserts, removals, [peer for _, peer in disco_upserts], disco_removals)

    def _changed_ids(self, peers: Mapping[int, nm.Node], *, everyone: bool) -> list[int]:
        """Ids of the peers added, removed or with another ``Node`` than last time (all of them
        with ``everyone``), in id order. One identity test per peer: no field is compared."""
        held = self._held
        if everyone:
            return sorted(held.keys() | peers.keys())
        changed = [pid for pid, node in peers.items() if (was := held.get(pid)) is None or was.node is not node]
        kept = len(peers) - sum(pid not in held for pid in changed)
        if len(held) > kept:  # some held peer is gone
            changed += [pid for pid in held if pid not in peers]
        return sorted(changed)


def _inputs(node: nm.Node) -> tuple[object, ...]:
    """The fields :func:`peer_spec` and :func:`disco_peer` read: a control server may resend every
    peer as changed (Headscale does on each policy-relevant change), and comparing these is far
    cheaper than projecting again."""
    return (node.expired, node.key, node.disco_key, node.home_derp, node.addresses, node.allowed_ips, node.endpoints)


_Held = TypeVar("_Held", "nat.PeerSpec", DiscoPeer)


def _key(value: nat.PeerSpec | DiscoPeer) -> bytes:
    return value.node_key if isinstance(value, DiscoPeer) else value[0]


def _replace(view: dict[bytes, tuple[int, _Held]], before: dict[bytes, tuple[int, _Held] | None], pid: int,
             old: _Held | None, new: _Held | None) -> None:
    """Peer ``pid``'s entry in ``view`` goes from ``old`` to ``new``; ``before`` keeps each touched
    key's entry as it was before the first touch."""
    if old is not None and view.get(key := _key(old)) == (pid, old):
        before.setdefault(key, view[key])
        del view[key]
    if new is not None:
        key = _key(new)
        before.setdefault(key, view.get(key))
        view[key] = (pid, new)


def _diff(view: dict[bytes, tuple[int, _Held]],
          before: dict[bytes, tuple[int, _Held] | None]) -> tuple[list[tuple[int, _Held]], list[bytes]]:
    """The touched keys' entries that changed (to upsert) and the keys that left (to remove)."""
    upserts: list[tuple[int, _Held]] = []
    removals: list[bytes] = []
    for key, was in before.items():
        now = view.get(key)
        if now is None:
            if was is not None:
                removals.append(key)
        elif now != was:
            upserts.append(now)
    return upserts, removals


def choose_home_region(derp_map: nm.DERPMap) -> int | None:
    """The lowest region id that can be a home (see the module docstring); None if there is none."""
    for region_id in sorted(derp_map.regions):
        region = derp_map.regions[region_id]
        if region.no_measure_no_home or region.avoid:
            continue
        if any(not n.stun_only for n in region.nodes):
            return region_id
    return None


def resolve_name(netmap: NetMap, name: str) -> str | None:
    """A peer's (or our own) IP for a MagicDNS name, ``host`` or ``host.<domain>``; IPv4 preferred.

    Matches the netmap's node ``Name`` (FQDN) exactly, or its first label; case-insensitive.
    """
    wanted = name.strip().rstrip(".").lower()
    if not wanted:
        return None
    for node in (*sorted(netmap.peers.values(), key=lambda p: p.id), netmap.self_node):
        fqdn = node.name.rstrip(".").lower()
        if not fqdn or node.expired:
            continue
        short = fqdn.split(".", 1)[0]
        domain = netmap.domain.rstrip(".").lower()
        if wanted in (fqdn, short) or (domain and wanted == f"{short}.{domain}"):
            addrs = sorted(node.addresses, key=lambda n: n.version)
            if addrs:
                return str(addrs[0].network_address)
    return None
