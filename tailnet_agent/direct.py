"""The node's direct path: one UDP socket, STUN, and disco deciding which peers get WireGuard over UDP.

With ``udp_port`` set the node binds one UDP socket, dual-stack where the host has IPv6 (IPv4 only
where it has not), reports its interface addresses with that port as endpoints (plus, per address
family, the address the home region's STUN server saw, refreshed every 20 s), and answers and
sends disco pings; a peer with a confirmed path, over IPv4 or IPv6, gets WireGuard over UDP
(the data plane reads and writes the socket in batches: no per-packet Python), the others keep
going through DERP. :meth:`DirectPath.run` re-pings paths in use and looks for paths to the
peers the node sends to, once a second and soon after traffic went through DERP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable

import structlog

from tailnet_agent import _native as nat
from tailnet_agent import stun
from tailnet_agent.control import ControlClient, NetMap
from tailnet_agent.control.client import ENDPOINT_LOCAL, ENDPOINT_STUN
from tailnet_agent.derp.connection import addresses_by_family
from tailnet_agent.disco import Action, Disco, NoteSource, SendDerp, SendUdp, SetDirect
from tailnet_agent.netif import local_ipv4_addresses, local_ipv6_addresses

log = structlog.get_logger("agent.node")

UDP_GRO = 104
"""Linux ``UDP_GRO`` socket option (``linux/udp.h``)."""
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
"""Linux socket options that exceed ``net.core.[rw]mem_max`` (with CAP_NET_ADMIN)."""
UDP_SOCKET_BUFFER = 7 << 20
"""UDP socket buffer size asked for: 7 MiB (tailscaled's ``socketBufferSize``)."""
ACTIVE_SECONDS = 45.0
"""A peer sent to within this long gets direct-path discovery and heartbeats (tailscaled's
``sessionActiveTimeout``)."""
STUN_INTERVAL = 20.0
"""Seconds between rounds of STUN requests (tailscaled re-STUNs every 20-26 s)."""
DISCO_TICK_SECONDS = 1.0
"""The disco loop's period; traffic through DERP brings the next tick forward (at most every 0.1 s)."""


def _grow_socket_buffers(sock: socket.socket) -> None:
    """Ask for 7 MiB send and receive buffers, as tailscaled does: the default (about 208 KiB) drops
    datagrams when a burst from a fast peer arrives between two reads. The FORCE options need
    CAP_NET_ADMIN; without it the kernel caps the size at net.core.[rw]mem_max."""
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, UDP_SOCKET_BUFFER)
        except OSError:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, plain, UDP_SOCKET_BUFFER)


def endpoint_text(addr: tuple[str, int]) -> str:
    """``ip:port``, or ``[ip]:port`` for IPv6, as endpoints are written in map requests."""
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"


def _bind_udp(port: int) -> socket.socket:
    """A non-blocking UDP socket on ``port``: dual-stack (IPv6, IPv4 mapped) where the host has
    IPv6, else IPv4 only."""
    try:
        return _bound(socket.AF_INET6, ("::", port))
    except OSError as exc:  # no IPv6 in this kernel or namespace
        log.info("UDP for direct paths over IPv4 only", reason=str(exc))
    return _bound(socket.AF_INET, ("0.0.0.0", port))


def _bound(family: socket.AddressFamily, address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setblocking(False)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class DirectPath:
    """UDP, STUN and disco of one node. ``port`` None means DERP only (no socket, no disco loop).

    ``netmap`` and ``home`` read the node's current netmap and home region; ``wake`` asks the
    node's pump for a poll.
    """

    def __init__(self, dataplane: nat.DataPlane, control: ControlClient, *, port: int | None,
                 netmap: Callable[[], NetMap | None], home: Callable[[], int], wake: Callable[[], None],
                 path_changed: Callable[[], None] = lambda: None, local_endpoints: bool = True) -> None:
        self._dataplane = dataplane
        self._local_endpoints = local_endpoints
        self._path_changed = path_changed
        self._control = control
        self._port = port
        self._netmap = netmap
        self._home = home
        self._wake = wake
        self._udp: socket.socket | None = None
        self._udp_writer = False
        self._stun_endpoints: dict[int, tuple[str, int]] = {}
        """IP version -> our address as a DERP node's STUN server saw it over that family."""
        self._stun_pending: dict[bytes, float] = {}
        """STUN transaction id -> when it was sent."""
        self._derp_traffic = asyncio.Event()
        """Set when the pump wrote to a relay: the disco loop looks for direct paths soon."""
        self.disco = self.new_disco()

    @property
    def enabled(self) -> bool:
        """The UDP socket is open."""
        return self._udp is not None

    @property
    def udp_port(self) -> int | None:
        return None if self._udp is None else int(self._udp.getsockname()[1])

    def note_derp_traffic(self) -> None:
        """Traffic went through a relay: look for a direct path soon."""
        self._derp_traffic.set()

    def rekey(self) -> None:
        """The node key changed: a new disco key too means a new node whose paths are found again."""
        keys = self._control.keys
        if keys.disco.public.raw != self.disco.public_key:
            self.apply([SetDirect(key, None) for key in self.disco.direct_peers()])
            self.disco = self.new_disco()
        else:
            self.disco.set_node_public(keys.node.public.raw)

    def new_disco(self) -> Disco:
        keys = self._control.keys
        disco = Disco(keys.disco.raw, keys.disco.public.raw, keys.node.public.raw)
        disco.endpoints = tuple(addr for addr, _ in self._endpoints())
        return disco

    @property
    def dual_stack(self) -> bool:
        """The socket speaks IPv6 as well as IPv4 (so peers' IPv6 endpoints are worth a ping)."""
        return self._udp is not None and self._udp.family == socket.AF_INET6

    def _local_addresses(self) -> list[str]:
        """The interface addresses offered as endpoints (IPv6 ones only from a dual-stack socket)."""
        if not self._local_endpoints:
            return []
        return local_ipv4_addresses() + (local_ipv6_addresses() if self.dual_stack else [])

    def _endpoints(self) -> list[tuple[tuple[str, int], int]]:
        """Our UDP endpoints with their type: interface addresses, then what STUN saw."""
        if self._udp is None:
            return []
        port = self._udp.getsockname()[1]
        found = [((ip, port), ENDPOINT_LOCAL) for ip in self._local_addresses()]
        for seen in self._stun_endpoints.values():
            if all(addr != seen for addr, _ in found):
                found.append((seen, ENDPOINT_STUN))
        return found

    def update_endpoints(self) -> None:
        """Refresh the endpoints disco offers and map requests carry (the disco loop reports changes)."""
        endpoints = self._endpoints()
        self.disco.endpoints = tuple(addr for addr, _ in endpoints)
        self._control.endpoints = [(endpoint_text(addr), kind) for addr, kind in endpoints]

    def _sendto(self, packet: bytes, addr: tuple[str, int]) -> None:
        """Send one datagram; an IPv4 address is IPv4-mapped on the dual-stack socket. A full socket
        or an unreachable address loses it (a ping or a STUN request: both are repeated)."""
        if self._udp is None:
            return
        if self.dual_stack and ":" not in addr[0]:
            addr = (f"::ffff:{addr[0]}", addr[1])
        with contextlib.suppress(OSError):
            self._udp.sendto(packet, addr)

    async def _send_stun(self, loop: asyncio.AbstractEventLoop) -> None:
        """Binding requests to the home region's STUN servers; answers arrive as StunUdp events."""
        # Requests of earlier rounds that were never answered are forgotten here.
        self._stun_pending = {tx: at for tx, at in self._stun_pending.items() if loop.time() - at <= STUN_INTERVAL}
        netmap = self._netmap()
        if self._udp is None or netmap is None or self._home() not in netmap.derp_map.regions:
            return
        for derp_node in netmap.derp_map.regions[self._home()].nodes:
            if derp_node.stun_port < 0:
                continue
            port = derp_node.stun_port or stun.DEFAULT_PORT
            for version, host in addresses_by_family(derp_node):
                if version == 6 and not self.dual_stack:
                    continue
                family = socket.AF_INET6 if version == 6 else socket.AF_INET
                try:
                    infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
                except OSError as exc:
                    log.debug("STUN server not resolved", host=host, family=f"IPv{version}", error=str(exc))
                    continue
                tx_id = stun.new_tx_id()
                self._stun_pending[tx_id] = loop.time()
                address = infos[0][4]
                self._sendto(stun.binding_request(tx_id), (str(address[0]), int(address[1])))

    def on_stun(self, payload: bytes) -> None:
        answer = stun.parse_response(payload)
        if answer is None or self._stun_pending.pop(answer[0], None) is None:
            return
        version = ipaddress.ip_address(answer[1][0]).version
        if answer[1] != self._stun_endpoints.get(version):
            log.info("STUN endpoint", address=endpoint_text(answer[1]))
            self._stun_endpoints[version] = answer[1]
            self.update_endpoints()

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._port is None:
            return
        sock = _bind_udp(self._port)
        with contextlib.suppress(OSError):  # coalesced receives (Linux >= 5.0); optional
            sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
        _grow_socket_buffers(sock)
        self._udp = sock
        self.update_endpoints()
        loop.add_reader(sock.fileno(), self._on_udp_readable)
        log.info("UDP for direct paths", port=sock.getsockname()[1],
                 endpoints=[text for text, _ in self._control.endpoints])

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._udp is None:
            return
        loop.remove_reader(self._udp.fileno())
        if self._udp_writer:
            loop.remove_writer(self._udp.fileno())
            self._udp_writer = False
        self._udp.close()
        self._udp = None

    def _on_udp_readable(self) -> None:
        if self._udp is not None and self._dataplane.udp_receive(self._udp.fileno()):
            self._wake()

    def flush(self) -> None:
        """Send queued datagrams; if the socket is full, finish when it is writable."""
        if self._udp is None:
            return
        left = self._dataplane.udp_send(self._udp.fileno())
        if not left and not self._udp_writer:
            return
        loop = asyncio.get_running_loop()
        if left and not self._udp_writer:
            loop.add_writer(self._udp.fileno(), self.flush)
            self._udp_writer = True
        elif not left and self._udp_writer:
            loop.remove_writer(self._udp.fileno())
            self._udp_writer = False

    def apply(self, actions: list[Action]) -> None:
        """Carry out what disco decided."""
        for action in actions:
            match action:
                case SendUdp(addr, packet):
                    self._sendto(packet, addr)
                case SendDerp(region, key, packet):
                    self._dataplane.derp_send(region, key, packet)
                    self._wake()
                case SetDirect(key, addr):
                    self._dataplane.set_peer_direct(key, addr)
                    self._path_changed()
                case NoteSource(addr, key):
                    self._dataplane.note_udp_source(addr[0], addr[1], key)

    async def run(self) -> None:
        """Heartbeats, discovery for the peers in use, path expiry: every second, and soon after
        traffic went through DERP (a peer just became worth a direct path)."""
        loop = asyncio.get_running_loop()
        reported: list[tuple[str, int]] = []
        stunned = float("-inf")
        while True:
            now = loop.time()
            if now - stunned >= STUN_INTERVAL and self._netmap() is not None:
                stunned = now
                self.update_endpoints()  # interface addresses may have changed too
                await self._send_stun(loop)
            if self._control.endpoints != reported and self._control.connected and self._netmap() is not None:
                reported = list(self._control.endpoints)
                await self._control.report_endpoints()
            self.apply(self.disco.tick(now, self._dataplane.active_peers(now - ACTIVE_SECONDS)))
            self._derp_traffic.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DISCO_TICK_SECONDS):
                    await self._derp_traffic.wait()
            await asyncio.sleep(0.1)  # rate limit; Disco itself limits pings per peer
