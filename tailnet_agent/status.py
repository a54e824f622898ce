"""What the agent sees, as the JSON of ``GET /status``: its node and, per target, the route to it.

The document's shape is the contract's (:mod:`tailnet_agent.contract.status`: :class:`EgressStatus`,
and in ingress mode :class:`IngressStatus`, where exposes take the place of targets); this module
fills it from what the agent holds in memory. ``state`` is worked out from the netmap alone
(:func:`route_state`); ``reachable``, ``latencyMs`` and ``checkedAt`` come from the last probe
(:mod:`tailnet_agent.probe`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tailnet_agent.contract.status import (
    NO_ROUTE,
    READY,
    UNKNOWN,
    UNRESOLVED,
    EgressStatus,
    ExposeEntry,
    FileEntry,
    IngressStatus,
    NodeEntry,
    TargetEntry,
    iso,
)
from tailnet_agent.contract.targets import Target
from tailnet_agent.control import NetMap
from tailnet_agent.control import netmap as nm
from tailnet_agent.dns import Lookup
from tailnet_agent.probe import ProbeResult
from tailnet_agent.projection import peer_routes

if TYPE_CHECKING:
    from tailnet_agent.forward import EgressForwarder
    from tailnet_agent.forward.ingress import Ingress
    from tailnet_agent.node import Node
    from tailnet_agent.targets import TargetsWatcher

@dataclass(frozen=True)
class RouteState:
    state: str
    message: str
    router: nm.Node | None = None


def node_name(node: nm.Node) -> str:
    """A node's MagicDNS name without the trailing dot (its hostname if it has none)."""
    return node.name.rstrip(".") or node.hostname


def find_router(netmap: NetMap, ip: str, *, accept_routes: bool = True) -> nm.Node | None:
    """The peer that carries ``ip``: the peer with that address, else the most specific route.

    Routes are what the data plane would use (:func:`~tailnet_agent.projection.peer_routes`:
    AllowedIPs, which Headscale fills with the primary routes; never exit routes).
    """
    address = ipaddress.ip_address(ip)
    best: tuple[int, nm.Node] | None = None
    for peer in sorted(netmap.peers.values(), key=lambda p: p.id):
        if peer.expired:
            continue
        if any(address == net.network_address and net.prefixlen == net.max_prefixlen for net in peer.addresses):
            return peer
        for net in peer_routes(peer, accept_routes=accept_routes):
            if address in net and (best is None or net.prefixlen > best[0]):
                best = (net.prefixlen, peer)
    return best[1] if best else None


def route_state(netmap: NetMap | None, target: Target, lookup: Lookup | None, *,
                accept_routes: bool = True) -> RouteState:
    """Ready (a peer carries the route), NoRoute, Unresolved, or Unknown (no netmap or not asked yet)."""
    if netmap is None:
        return RouteState(UNKNOWN, "no netmap from control yet")
    if lookup is None:
        return RouteState(UNKNOWN, f"{target.address} has not been resolved yet")
    if lookup.address is None:
        return RouteState(UNRESOLVED, lookup.error or f"{target.address} does not resolve")
    ip = lookup.address
    shown = ip if ip == target.address else f"{target.address} ({ip})"
    router = find_router(netmap, ip, accept_routes=accept_routes)
    if router is None:
        return RouteState(NO_ROUTE, f"no peer in the netmap carries a route to {shown}")
    how = "is" if any(str(n.network_address) == ip for n in router.addresses) else "routed by"
    return RouteState(READY, f"{shown} {how} {node_name(router)}", router)


def target_entry(netmap: NetMap | None, target: Target, lookup: Lookup | None, probe: ProbeResult | None, *,
                 accept_routes: bool = True) -> TargetEntry:
    """One element of ``targets``."""
    route = route_state(netmap, target, lookup, accept_routes=accept_routes)
    message = route.message
    if probe is not None and not probe.reachable and probe.error:
        message = f"{message}; last probe failed: {probe.error}"
    return {
        "name": target.name,
        "address": target.address,
        "ports": [m.port for m in target.ports],
        "state": route.state,
        "router": node_name(route.router) if route.router else None,
        "routerId": str(route.router.id) if route.router else None,
        "message": message,
        "reachable": probe.reachable if probe else None,
        "latencyMs": probe.latency_ms if probe else None,
        "checkedAt": iso(probe.checked_at) if probe else None,
    }


def node_entry(netmap: NetMap | None, hostname: str, addresses: list[str]) -> NodeEntry:
    """``node``: Headscale's node id (as its API spells it) and name once a netmap arrived."""
    if netmap is None:
        return {"id": None, "name": hostname, "addresses": addresses}
    return {"id": str(netmap.self_node.id), "name": node_name(netmap.self_node) or hostname, "addresses": addresses}


def status_document(*, netmap: NetMap | None, hostname: str, addresses: list[str], targets: tuple[Target, ...],
                    lookups: Mapping[str, Lookup | None], probes: Mapping[str, ProbeResult],
                    targets_error: str | None = None, loaded_at: datetime | None = None,
                    accept_routes: bool = True) -> EgressStatus:
    """The whole ``/status`` document (``lookups`` by target address, ``probes`` by target name)."""
    return {
        "node": node_entry(netmap, hostname, addresses),
        "targets": [target_entry(netmap, t, lookups.get(t.address), probes.get(t.name), accept_routes=accept_routes)
                    for t in targets],
        "targetsFile": {"error": targets_error, "loadedAt": iso(loaded_at) if loaded_at else None},
    }


def egress_status(node: Node, forwarder: EgressForwarder, watcher: TargetsWatcher[Target] | None) -> EgressStatus:
    """The running agent's document: reads only what is in memory (no I/O, no DNS query)."""
    targets = forwarder.targets
    document = status_document(
        netmap=node.netmap, hostname=node.options.control.hostname, addresses=node.addresses(), targets=targets,
        lookups={t.address: node.resolver.cached(t.address) for t in targets},
        probes=forwarder.prober.results if forwarder.prober else {},
        targets_error=watcher.state.error if watcher else None,
        loaded_at=watcher.state.loaded_at if watcher else None, accept_routes=node.options.accept_routes)
    for entry in document["targets"]:
        if (problem := forwarder.listen_errors.get(entry["name"])) is not None:
            entry["message"] = f"{entry['message']}; not listening: {problem}"
    return document


def file_entry(watcher: TargetsWatcher[Any] | None) -> FileEntry:
    """``targetsFile`` / ``exposesFile``: the followed file's last error and when the list was read."""
    loaded = watcher.state.loaded_at if watcher else None
    return {"error": watcher.state.error if watcher else None, "loadedAt": iso(loaded) if loaded else None}


def ingress_status(node: Node, ingress: Ingress, watcher: TargetsWatcher[Any] | None) -> IngressStatus:
    """The ingress document: per expose whether it listens, the backend's last probe, each host's
    certificate (its files are checked for a change first)."""
    forwarder = ingress.forwarder
    probes = forwarder.prober.results if forwarder.prober else {}
    exposes: list[ExposeEntry] = []
    for expose in forwarder.targets:
        probe = probes.get(expose.name)
        service = ingress.services.get(expose.name)
        exposes.append({
            "name": expose.name, "port": expose.port, "mode": expose.mode,
            "listening": forwarder.is_listening(expose.name), "message": forwarder.listen_errors.get(expose.name),
            "backend": f"{expose.backend.host}:{expose.backend.port}",
            "reachable": probe.reachable if probe else None, "latencyMs": probe.latency_ms if probe else None,
            "checkedAt": iso(probe.checked_at) if probe else None,
            "backendError": probe.error if probe and not probe.reachable else None,
            "hosts": service.certs.status() if service else [],
        })
    return {"node": node_entry(node.netmap, node.options.control.hostname, node.addresses()),
            "exposes": exposes, "exposesFile": file_entry(watcher)}
