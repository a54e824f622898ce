"""The pure projection of a netmap onto the node: data plane input (addresses, peers with their
routes and home region, packet filter), disco's peers, the home DERP region, MagicDNS names.

No I/O and no state: a :class:`~tailnet_agent.control.NetMap` in, plain values out. Routing
follows ``routemanager.peerViewOf``: a peer's own addresses are always routable; its other
AllowedIPs (subnet routes Headscale puts there for the primary router) only with accept-routes;
exit routes (``0.0.0.0/0``, ``::/0``) never, since this node does not select an exit node. Peers
that are expired, or have neither a disco key nor a home DERP region, are left out.
"""

from __future__ import annotations

import contextlib
import ipaddress

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


def peer_specs(netmap: NetMap, *, accept_routes: bool, fallback_region: int) -> list[nat.PeerSpec]:
    """``set_peers`` input: (raw node key, AllowedIPs, home region; ``fallback_region`` if unknown)."""
    specs: list[nat.PeerSpec] = []
    for peer in sorted(netmap.peers.values(), key=lambda p: p.id):
        if peer.expired or not peer.key.startswith("nodekey:"):
            continue
        if not peer.disco_key and not peer.home_derp:
            continue
        try:
            key = bytes.fromhex(peer.key.removeprefix("nodekey:"))
        except ValueError:
            log.warning("peer with a malformed node key skipped", peer=peer.name or peer.id)
            continue
        if len(key) != 32:
            continue
        routes = [str(net) for net in peer_routes(peer, accept_routes=accept_routes)]
        specs.append((key, routes, peer.home_derp or fallback_region))
    return specs


def filter_rules(netmap: NetMap) -> list[nat.FilterRule]:
    """The netmap's packet filter in the data plane's rule shape (``cap:`` sources pass through;
    the data plane ignores them)."""
    return [(list(rule.src_ips), [(p.ip, p.first, p.last) for p in rule.dst_ports], list(rule.ip_proto))
            for rule in netmap.packet_filter]


def disco_peers(netmap: NetMap, *, fallback_region: int, ipv6: bool = False) -> list[DiscoPeer]:
    """Disco's view of the peers: raw node and disco keys, ``ip:port`` endpoints (IPv4, and
    ``[ip]:port`` IPv6 ones with ``ipv6``: the node's UDP socket is dual-stack), home region."""
    out: list[DiscoPeer] = []
    for peer in netmap.peers.values():
        if peer.expired or not peer.key.startswith("nodekey:") or not peer.disco_key.startswith("discokey:"):
            continue
        try:
            node_key = bytes.fromhex(peer.key.removeprefix("nodekey:"))
            disco_key = bytes.fromhex(peer.disco_key.removeprefix("discokey:"))
        except ValueError:
            continue
        endpoints = []
        for text in peer.endpoints:
            host, _, port = text.rpartition(":")
            with contextlib.suppress(ValueError):
                ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
                # A link-local address names an interface of the peer's machine: not one to send to.
                if (ip.version == 4 or (ipv6 and not ip.is_link_local)) and 0 < int(port) < 65536:
                    endpoints.append((str(ip), int(port)))
        out.append(DiscoPeer(node_key, disco_key, tuple(endpoints), peer.home_derp or fallback_region))
    return out



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
