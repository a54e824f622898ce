"""One userspace tailnet node: control client, DERP relays and the native data plane under one TaskGroup.

``Node.run`` blocks until cancelled. Inside its TaskGroup:

* ``control``: the :class:`ControlClient`; each netmap it delivers is pushed into the data plane
  (self addresses, peers with their AllowedIPs and home DERP region, packet filter);
* ``derp-manager``: :class:`~tailnet_agent.relays.Relays` keeps one ``DerpSupervisor`` per DERP
  region in use: the home region, plus every region a peer is homed in, since a peer must be sent
  to through *its* region; it reports the home region to control so peers send to us there;
* ``derp-<region>``: the supervisors; their handlers feed what they read into ``derp_feed``;
* ``pump``: the only place ``poll`` runs. Anything that gives the data plane work (DERP bytes, app
  writes and reads, dials, a ``next_deadline`` timer via ``loop.call_at``) calls :meth:`Node.wake`;
  the pump polls once per wake-up batch, writes ``derp_writes`` to the relays (waiting on ``drain``
  for backpressure) and hands TCP events to the :class:`~tailnet_agent.streams.StreamTable`;
* ``disco`` (with a UDP socket): :meth:`DirectPath.run <tailnet_agent.direct.DirectPath.run>`
  re-pings paths in use and looks for direct paths to the peers the node sends to;
* the handlers of connections accepted by :meth:`Node.start_server`.

Home DERP region: the lowest region id of the DERP map that may be a home (not ``NoMeasureNoHome``,
with a non-STUN-only node). tailscaled measures latency instead; with Headscale's single embedded
region the choice is the same. The region stays the home while it is in the map.

What the node pushes into the data plane is the projection of each netmap
(:mod:`tailnet_agent.projection`: routes, peers, packet filter, home region, MagicDNS), and only
what changed: the peers a message added, changed or removed (``upsert_peers``, ``remove_peers``,
:meth:`Disco.update_peers <tailnet_agent.disco.Disco.update_peers>`), the filter when it differs.

Node-key rotation: when control rotates the node key (the key expired, or the node was expired by an
admin), the next netmap switches the data plane to the new key (WireGuard sessions restart, TCP
connections stay), and every DERP connection is re-made with it, since a relay knows a client by its
key. The home region is reported again.

Parts, each its own module: the pure netmap projection (:mod:`tailnet_agent.projection`), the
DERP relays (:mod:`tailnet_agent.relays`), the direct path: UDP socket, STUN and disco
(:mod:`tailnet_agent.direct`); the node itself keeps the dial/listen API and the pump.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from tailnet_agent import _native as nat
from tailnet_agent.contract.addresses import host_route
from tailnet_agent.contract.backoff import Backoff
from tailnet_agent.contract.clock import Clock, RealClock
from tailnet_agent.control import ControlClient, ControlOptions, NetMap, NodeKeys
from tailnet_agent.control.netmap import FilterRule
from tailnet_agent.derp import DerpConnection, tls_context
from tailnet_agent.direct import DirectPath
from tailnet_agent.disco import Disco
from tailnet_agent.dns import DnsError, Resolver, lookup_static
from tailnet_agent.projection import PeerProjection, choose_home_region, filter_rules, self_addresses
from tailnet_agent.pump import Pump
from tailnet_agent.relays import Relays
from tailnet_agent.streams import ClientConnected, DialError, StreamTable, TailnetServer

log = structlog.get_logger("agent.node")


# -- options and errors ---------------------------------------------------------------------------


class UnknownNameError(DialError):
    """A dial target that is neither an IP, a MagicDNS name, an extra record nor a name the tailnet's
    split DNS answers."""

    reason = "unknown_name"
    code = errno.ENOENT


class NotRunningError(OSError):
    """The node's ``run`` is not active (not started yet, or stopped)."""

    reason = "not_running"


@dataclass(kw_only=True)
class NodeOptions:
    control: ControlOptions
    """How to reach and join the control server (URL, pre-auth key, hostname, CA, backoff); its
    ``ca_bundle`` also verifies the DERP relays."""
    accept_routes: bool = True
    """Route to peers' subnet routes (``--accept-routes``). Default true (egress)."""
    dial_timeout: float = 30.0
    """Seconds without a SYN-ACK before a dial fails. Default 30."""
    tcp_buffer_size: int | None = None
    """Per-connection send and receive buffer in bytes; None keeps the data plane's 512 KiB."""
    derp_backoff: Backoff | None = None
    """None uses tailscaled's 0.1 s to 5 s schedule (one Backoff per region)."""
    derp_read_timeout: float = 120.0
    """Seconds without any byte from a relay before it is reconnected (the server keeps alive every 60 s)."""
    udp_port: int | None = 0
    """UDP port for direct paths (disco and WireGuard); 0 picks a free one; None: DERP only."""
    local_endpoints: bool = True
    """Offer the interface addresses as endpoints; False offers only what STUN saw (tailscaled's
    ``TS_DEBUG_OMIT_LOCAL_ADDRS``), so a test can say which family a peer reaches the node over."""
    shared_addresses: tuple[str, ...] = ()
    """Addresses this node shares with others (an ingress's replicas): each is advertised as a host
    route (``control.routes`` gains it) and answered as the node's own; control sends it to one of
    the advertisers at a time (Headscale's HA subnet routes)."""


# -- the node -------------------------------------------------------------------------------------


class Node:
    """A userspace tailnet node. ``run`` blocks until cancelled; dial and listen while it runs."""

    def __init__(self, options: NodeOptions, keys: NodeKeys | None = None, *, clock: Clock | None = None) -> None:
        self.options = options
        self.clock: Clock = clock or RealClock()
        self.shared_routes = tuple(host_route(a) for a in options.shared_addresses)
        """The host routes of ``options.shared_addresses`` (``198.18.5.10/32``)."""
        control = options.control
        if self.shared_routes:
            control = replace(control, routes=tuple(dict.fromkeys((*control.routes, *self.shared_routes))))
        self.control = ControlClient(control, keys or NodeKeys.generate(), on_netmap=self._on_netmap)
        self._node_key = self.control.keys.node.raw
        kwargs = {} if options.tcp_buffer_size is None else {"tcp_buffer_size": options.tcp_buffer_size}
        self.dataplane = nat.DataPlane(self._node_key, **kwargs)
        if options.shared_addresses:
            self.dataplane.set_shared(list(options.shared_addresses))
        self.netmap: NetMap | None = None
        self.home_region = 0
        """Home DERP region id; 0 until the first netmap with a DERP map."""
        self.direct = DirectPath(self.dataplane, self.control, port=options.udp_port, netmap=lambda: self.netmap,
                                 home=lambda: self.home_region, wake=self.wake, path_changed=self._notify,
                                 local_endpoints=options.local_endpoints)
        self.relays = Relays(self.dataplane, tls=tls_context(options.control.ca_bundle),
                             read_timeout=options.derp_read_timeout, backoff=options.derp_backoff,
                             wake=self.wake, notify=self._notify, report_home=self.control.set_preferred_derp)
        self.pump = Pump(self.dataplane, self.relays, self.direct, lambda: self._streams)
        """Moves the data plane's output to the relays, the direct path and the streams."""
        self.resolver = Resolver(lambda: self.netmap, self._dial_resolver, self.clock)
        """Names beyond MagicDNS: extra records and split DNS (:mod:`tailnet_agent.dns`)."""
        self._addresses: list[str] = []
        self._projection = PeerProjection()
        """The peers as last pushed: a netmap re-projects and pushes only what it changed."""
        self._disco_fed: Disco | None = None
        """The Disco the projection's updates went to (a new disco key makes a new one)."""
        self._filters: Mapping[str, tuple[FilterRule, ...]] | None = None
        """The named packet filters last compiled into the data plane; None before the first."""
        self._changed = asyncio.Event()
        self._started_at = 0.0
        self._tg: asyncio.TaskGroup | None = None
        self._streams: StreamTable | None = None

    # -- lifecycle --

    async def run(self) -> None:
        """Run the node until cancelled. A refused pre-auth key (``RegistrationError``) ends it."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._streams = StreamTable(self.dataplane, wake=self.wake, spawn=self._spawn, loop=loop)
                self._started_at = loop.time()
                self.direct.open(loop)
                tg.create_task(self.control.run(), name="control")
                tg.create_task(self.pump.run(), name="pump")
                tg.create_task(self.relays.run(tg), name="derp-manager")
                if self.direct.enabled:
                    tg.create_task(self.direct.run(), name="disco")
                self._notify()
        finally:
            self._tg = None
            self.direct.close(loop)
            if self._streams is not None:
                self._streams.abort_all(NotRunningError("the tailnet node stopped"))
                self._streams = None
            self._notify()

    def shared_quiet_for(self) -> float:
        """Seconds since a connection to a shared address was last accepted (since the node started
        when none was): how long peers have stopped sending new connections here."""
        if self._streams is None:
            return float("inf")
        accepted = [self._streams.last_accepted.get(str(ipaddress.ip_address(a)))
                    for a in self.options.shared_addresses]
        last = max((t for t in accepted if t is not None), default=self._started_at)
        return self._streams.loop.time() - last

    async def withdraw_shared(self) -> bool:
        """Stop advertising the shared addresses (they stay answered here), so that control moves
        them to another advertiser. Returns whether control took the change now."""
        if not self.shared_routes:
            return True
        return await self.control.set_routes(tuple(r for r in self.control.routes if r not in self.shared_routes))

    async def logout(self) -> bool:
        """Log out of control (the node stays up until ``run`` is cancelled, but registers no
        more): Headscale deletes an ephemeral node at once. Returns whether control took it."""
        return await self.control.logout()

    @property
    def running(self) -> bool:
        return self._tg is not None

    @property
    def ready(self) -> bool:
        """Traffic can flow: a netmap arrived, and the home DERP region is connected or a peer is
        reached over a direct UDP path. An outage of Headscale and its DERP server thus leaves the
        node ready (and new connections working) as long as its direct paths hold."""
        return self.netmap is not None and (self.home_region in self.derp_connections or self.direct_peer_count > 0)

    @property
    def derp_connections(self) -> dict[int, DerpConnection]:
        """The connected relay of each DERP region in use."""
        return self.relays.connections

    @property
    def control_connected(self) -> bool:
        """The control connection is up (between connect and loss)."""
        return self.control.connected

    async def wait_ready(self) -> None:
        """Wait until :attr:`ready`."""
        while not self.ready:
            await self._changed.wait()

    @property
    def disco(self) -> Disco:
        """Disco's state (direct paths per peer)."""
        return self.direct.disco

    @property
    def direct_peer_count(self) -> int:
        """Peers reached over a direct UDP path right now."""
        return len(self.direct.disco.direct_peers())

    @property
    def udp_port(self) -> int | None:
        """The port of the UDP socket for direct paths; None without one."""
        return self.direct.udp_port

    def addresses(self) -> list[str]:
        """The node's tailnet IPs (no prefix length)."""
        return [a.split("/")[0] for a in self._addresses]

    # -- dial and listen --

    def resolve(self, host: str) -> str:
        """IP literal, MagicDNS name or extra record, without any query; raises :class:`UnknownNameError`."""
        if (ip := lookup_static(self.netmap, host)) is not None:
            return ip
        raise UnknownNameError(f"cannot resolve {host!r}: not an IP and no tailnet node has that MagicDNS name")

    async def lookup(self, host: str) -> str:
        """:meth:`resolve`, then the tailnet's split DNS; raises :class:`UnknownNameError` saying why."""
        try:
            return await self.resolver.resolve(host)
        except DnsError as exc:
            raise UnknownNameError(str(exc)) from None

    async def _dial_resolver(self, ip: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await self._require_streams().open_connection(ip, port, host=ip, timeout=self.options.dial_timeout)

    async def open_connection(self, host: str, port: int, *, timeout: float | None = None,
                              ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Dial ``host:port`` over the tailnet (tailnet IP, IP in an accepted route, MagicDNS name, or a
        name the tailnet's DNS configuration answers: :mod:`tailnet_agent.dns`).

        ``timeout`` defaults to ``options.dial_timeout`` seconds. Raises ``OSError`` subclasses with a
        clear message and a ``reason``: :class:`~tailnet_agent.streams.NoRouteError`,
        :class:`~tailnet_agent.streams.DialRefusedError`, :class:`~tailnet_agent.streams.DialTimeoutError`,
        :class:`UnknownNameError`, :class:`NotRunningError`.
        """
        streams = self._require_streams()
        ip = await self.lookup(host)
        return await streams.open_connection(ip, port, host=host, timeout=timeout or self.options.dial_timeout)

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                                timeout: float | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]:
        """:meth:`open_connection` with a protocol instead of streams (``loop.create_connection``)."""
        streams = self._require_streams()
        ip = await self.lookup(host)
        return await streams.create_connection(protocol_factory, ip, port, host=host,
                                               timeout=timeout or self.options.dial_timeout)

    def start_server(self, client_connected_cb: ClientConnected, port: int) -> TailnetServer:
        """Accept tailnet connections on ``port`` (all node addresses; the packet filter applies).

        Each connection's callback runs as a task of the node's TaskGroup; its errors are logged."""
        return self._require_streams().start_server(client_connected_cb, port)

    async def listen(self, protocol_factory: Callable[[], asyncio.Protocol], port: int) -> TailnetServer:
        """:meth:`start_server` with a protocol per connection (``loop.create_server``'s shape); its
        connections are served by whoever made the protocol."""
        return self._require_streams().start_server(None, port, protocol_factory=protocol_factory)

    def _require_streams(self) -> StreamTable:
        if self._streams is None:
            raise NotRunningError(errno.ENOTCONN, "the tailnet node is not running")
        return self._streams

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tg is None:
            coro.close()
            return
        self._tg.create_task(coro, name=name)

    # -- netmap --

    def _on_netmap(self, netmap: NetMap) -> None:
        """Push a new netmap into the data plane (called by the control client, synchronously).

        Only what the netmap changed is pushed: the peers it added, changed or removed, and the
        packet filter when it differs, so a message costs what it carries, not the tailnet's size."""
        first = self.netmap is None
        self.netmap = netmap
        if self.control.keys.node.raw != self._node_key:
            self._use_new_node_key()
        addresses = self_addresses(netmap)
        if addresses != self._addresses:
            self.dataplane.set_self(addresses)
            self._addresses = addresses
            log.info("tailnet addresses", addresses=self.addresses())
        if not self.home_region or self.home_region not in netmap.derp_map.regions:
            self.home_region = choose_home_region(netmap.derp_map) or 0
        self._push_peers(netmap)
        self._push_filter(netmap)
        if first:
            log.info("first netmap", peers=len(netmap.peers), home_region=self.home_region)
        self.relays.update(netmap, home=self.home_region, node_key=self._node_key)
        self._notify()
        self.wake()

    def _use_new_node_key(self) -> None:
        """Control rotated the node key: switch the data plane and re-make every DERP connection."""
        self._node_key = self.control.keys.node.raw
        self.dataplane.set_private_key(self._node_key)
        self.direct.rekey()
        self.relays.rekey()
        log.info("node key rotated; DERP connections re-made with the new key",
                 node_key=self.control.keys.node.public.short())

    def _push_peers(self, netmap: NetMap) -> None:
        """The peers this netmap added, changed or removed, to the data plane and to disco."""
        changes = self._projection.update(netmap.peers, accept_routes=self.options.accept_routes,
                                          fallback_region=self.home_region, ipv6=self.direct.dual_stack)
        if changes.removals:
            self.dataplane.remove_peers(changes.removals)
        if changes.upserts:
            self.dataplane.upsert_peers(changes.upserts)
        disco = self.direct.disco
        if disco is self._disco_fed:
            self.direct.apply(disco.update_peers(changes.disco_upserts, changes.disco_removals))
        else:  # a new Disco (the first, or one for a new disco key) holds no peer yet
            self.direct.apply(disco.set_peers(self._projection.disco_peers()))
            self._disco_fed = disco

    def _push_filter(self, netmap: NetMap) -> None:
        """Project and compile the packet filter only when it changed: a map message that does not
        touch the filters keeps their very mapping, and one that resends them is compared first."""
        filters = netmap.packet_filters
        if filters is self._filters or (self._filters is not None and filters == self._filters):
            return
        self.dataplane.set_filter(filter_rules(netmap))
        self._filters = filters

    # -- the pump --

    def wake(self) -> None:
        """Ask the pump for a poll (coalesced)."""
        self.pump.wake()

    @property
    def counters(self) -> dict[str, int]:
        """The data plane's cumulative counters as of the last poll."""
        return self.pump.counters

    @property
    def derp_writes_dropped(self) -> int:
        """Batches of DERP frames dropped because their region had no connection."""
        return self.pump.derp_writes_dropped

    def _notify(self) -> None:
        previous, self._changed = self._changed, asyncio.Event()
        previous.set()
