"""Disco: finding and keeping direct UDP paths to peers (tailscale's ``disco`` and ``magicsock``).

A disco packet is ``"TS💬"`` + the sender's disco public key + a NaCl box (random nonce) to the
receiver's disco key. Its plaintext is ``type, version 0, body``:

* Ping (1): TxID (12 bytes) + the sender's node key (32); padding may follow;
* Pong (2): TxID + the address the ping came from (16-byte IP, IPv4-mapped, + u16 port);
* CallMeMaybe (3): the sender's endpoints, 18 bytes each, sent over DERP to ask for pings.

:class:`Disco` holds the path state and is sans-IO: handlers take a packet and the time, and
return :data:`Action` s for the node to carry out. The rules follow tailscaled:

* every Ping is answered with a Pong on the path it came in on (over UDP, to the address it came
  from, which also tells the data plane that WireGuard from there is that peer's); after our UDP
  pong, tailscaled sends WireGuard to us directly;
* a peer the node sends to gets pings to each of its endpoints (at most every
  :data:`DISCOVERY_INTERVAL`) and a CallMeMaybe through DERP, so it pings us too;
* a Pong to one of our pings makes its address the peer's direct path if none is trusted or it
  is faster; a path is trusted for :data:`TRUST_SECONDS` after its last pong and re-pinged
  every :data:`HEARTBEAT_SECONDS` while the peer is in use; when trust runs out without a pong
  the peer goes back to DERP.

Messages that do not open with a known peer's disco key are ignored, so only nodes in the netmap
can steer traffic; WireGuard still authenticates every data packet.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import structlog

from tailnet_agent.derp.errors import CryptoError
from tailnet_agent.derp.frames import open_box, seal

log = structlog.get_logger("agent.disco")

MAGIC = b"TS\xf0\x9f\x92\xac"
KEY_LEN = 32
NONCE_LEN = 24
PING, PONG, CALL_ME_MAYBE = 1, 2, 3
TX_ID_LEN = 12
ENDPOINT_LEN = 18
TRUST_SECONDS = 6.5
"""How long a pong keeps a direct path in use (tailscaled's ``trustUDPAddrDuration``)."""
HEARTBEAT_SECONDS = 3.0
"""Re-ping interval of a path in use (tailscaled's ``heartbeatInterval``)."""
DISCOVERY_INTERVAL = 5.0
"""Least time between rounds of discovery pings to one peer without a path."""
PING_TIMEOUT = 5.0
"""Pings not answered within this long are forgotten."""

Addr = tuple[str, int]


# -- messages --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ping:
    tx_id: bytes
    node_key: bytes = b""


@dataclass(frozen=True)
class Pong:
    tx_id: bytes
    src: Addr


@dataclass(frozen=True)
class CallMeMaybe:
    endpoints: tuple[Addr, ...]


Message = Ping | Pong | CallMeMaybe


def _pack_addr(addr: Addr) -> bytes:
    ip = ipaddress.ip_address(addr[0])
    raw = ip.packed if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}").packed
    return raw + struct.pack("!H", addr[1])


def _unpack_addr(data: bytes) -> Addr:
    ip = ipaddress.IPv6Address(data[:16])
    host = ip.ipv4_mapped or ip
    return str(host), struct.unpack("!H", data[16:18])[0]


def encode(message: Message) -> bytes:
    """The plaintext of a message: type, version 0, body."""
    match message:
        case Ping(tx_id, node_key):
            return bytes([PING, 0]) + tx_id + node_key
        case Pong(tx_id, src):
            return bytes([PONG, 0]) + tx_id + _pack_addr(src)
        case CallMeMaybe(endpoints):
            return bytes([CALL_ME_MAYBE, 0]) + b"".join(_pack_addr(e) for e in endpoints)


def decode(plaintext: bytes) -> Message | None:
    """A message from its plaintext; None for unknown types or short bodies (ignored, as tailscaled)."""
    if len(plaintext) < 2:
        return None
    kind, body = plaintext[0], plaintext[2:]
    if kind == PING and len(body) >= TX_ID_LEN:
        key = body[TX_ID_LEN:TX_ID_LEN + KEY_LEN]
        return Ping(body[:TX_ID_LEN], key if len(key) == KEY_LEN else b"")
    if kind == PONG and len(body) >= TX_ID_LEN + ENDPOINT_LEN:
        return Pong(body[:TX_ID_LEN], _unpack_addr(body[TX_ID_LEN:TX_ID_LEN + ENDPOINT_LEN]))
    if kind == CALL_ME_MAYBE and len(body) % ENDPOINT_LEN == 0:
        return CallMeMaybe(tuple(_unpack_addr(body[i:i + ENDPOINT_LEN]) for i in range(0, len(body), ENDPOINT_LEN)))
    return None


def seal_packet(private_key: bytes, public_key: bytes, peer_disco: bytes, message: Message) -> bytes:
    """A disco packet from us (``public_key``) to ``peer_disco``."""
    return MAGIC + public_key + seal(private_key, peer_disco, encode(message))


def open_packet(private_key: bytes, packet: bytes) -> tuple[bytes, Message] | None:
    """(sender disco key, message) of a packet addressed to us; None if it does not open."""
    if not packet.startswith(MAGIC) or len(packet) < len(MAGIC) + KEY_LEN + NONCE_LEN:
        return None
    sender = packet[len(MAGIC):len(MAGIC) + KEY_LEN]
    try:
        plaintext = open_box(private_key, sender, packet[len(MAGIC) + KEY_LEN:])
    except CryptoError:
        return None
    message = decode(plaintext)
    return None if message is None else (sender, message)


# -- actions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendUdp:
    addr: Addr
    packet: bytes


@dataclass(frozen=True)
class SendDerp:
    region: int
    node_key: bytes
    packet: bytes


@dataclass(frozen=True)
class SetDirect:
    """Send WireGuard for ``node_key`` to ``addr``; None: through DERP again."""

    node_key: bytes
    addr: Addr | None


@dataclass(frozen=True)
class NoteSource:
    """UDP from ``addr`` is ``node_key``'s."""

    addr: Addr
    node_key: bytes


Action = SendUdp | SendDerp | SetDirect | NoteSource


# -- path state ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiscoPeer:
    """What disco needs of a netmap peer (raw keys)."""

    node_key: bytes
    disco_key: bytes
    endpoints: tuple[Addr, ...]
    derp_region: int


@dataclass
class _Path:
    addr: Addr | None = None
    latency: float = 0.0
    trusted_until: float = 0.0
    last_ping: float = float("-inf")
    """When pings last went to this peer (discovery or heartbeat)."""
    extra_endpoints: set[Addr] = field(default_factory=set)
    """Addresses learned from CallMeMaybe and from pings that came in."""


@dataclass(frozen=True)
class _SentPing:
    node_key: bytes
    addr: Addr
    at: float


class Disco:
    """Disco path state for one node. Not thread-safe; call from the event loop."""

    def __init__(self, private_key: bytes, public_key: bytes, node_public: bytes) -> None:
        self._private = private_key
        self._public = public_key
        self._node_public = node_public
        self._peers: dict[bytes, DiscoPeer] = {}
        self._by_disco: dict[bytes, bytes] = {}
        self._paths: dict[bytes, _Path] = {}
        self._pings: dict[bytes, _SentPing] = {}
        self.endpoints: tuple[Addr, ...] = ()
        """Our own endpoints, sent in CallMeMaybe."""

    @property
    def public_key(self) -> bytes:
        """Our disco public key (raw)."""
        return self._public

    @property
    def peers(self) -> Mapping[bytes, DiscoPeer]:
        """The peers disco holds, by node key (those whose disco key can be sealed to)."""
        return MappingProxyType(self._peers)

    # -- inputs --

    def set_peers(self, peers: Iterable[DiscoPeer]) -> list[Action]:
        """The netmap's peers; paths of peers that left or changed disco key are dropped. A disco
        key is checked once: a peer already held with the same key passed the check then."""
        peers = list(peers)
        wanted = {p.node_key for p in peers}
        return self.update_peers(peers, [key for key in self._peers if key not in wanted])

    def update_peers(self, changed: Iterable[DiscoPeer], removed: Iterable[bytes]) -> list[Action]:
        """:meth:`set_peers` for the peers a netmap changed: ``changed`` added or updated, the node
        keys ``removed`` gone; every other peer and its path stay as they are."""
        actions: list[Action] = []
        for key in removed:
            self._forget(key)
        for peer in changed:
            held = self._peers.get(peer.node_key)
            if len(peer.disco_key) != KEY_LEN or not (
                    (held is not None and held.disco_key == peer.disco_key) or self._can_seal(peer.disco_key)):
                self._forget(peer.node_key)
                continue
            if held is not None and held.disco_key != peer.disco_key:
                path = self._paths.get(peer.node_key)
                if path is not None and path.addr is not None:
                    actions.append(SetDirect(peer.node_key, None))
                self._forget(peer.node_key)
            self._peers[peer.node_key] = peer
            self._by_disco[peer.disco_key] = peer.node_key
        return actions

    def _forget(self, node_key: bytes) -> None:
        """Drop a peer and its path (its WireGuard leaves the data plane with it, or never had a path)."""
        held = self._peers.pop(node_key, None)
        self._paths.pop(node_key, None)
        if held is not None and self._by_disco.get(held.disco_key) == node_key:
            del self._by_disco[held.disco_key]

    def set_node_public(self, node_public: bytes) -> None:
        """Our node key changed (rotation): pings carry the new one."""
        self._node_public = node_public

    def direct_peers(self) -> list[bytes]:
        """Node keys of the peers with a direct path in use."""
        return [key for key, path in self._paths.items() if path.addr is not None]

    def direct_path(self, node_key: bytes) -> Addr | None:
        path = self._paths.get(node_key)
        return path.addr if path else None

    def handle_udp(self, src: Addr, packet: bytes, now: float) -> list[Action]:
        opened = open_packet(self._private, packet)
        if opened is None:
            return []
        sender, message = opened
        node_key = self._by_disco.get(sender)
        if node_key is None:
            return []
        match message:
            case Ping(tx_id, ping_key):
                if ping_key and ping_key != node_key:
                    return []
                self._path(node_key).extra_endpoints.add(src)
                return [NoteSource(src, node_key), SendUdp(src, self._seal(sender, Pong(tx_id, src)))]
            case Pong(tx_id, _):
                return self._on_pong(node_key, tx_id, src, now)
            case CallMeMaybe():
                return []  # CallMeMaybe is only valid over DERP

    def handle_derp(self, region: int, src_node_key: bytes, packet: bytes, now: float) -> list[Action]:
        opened = open_packet(self._private, packet)
        if opened is None:
            return []
        sender, message = opened
        node_key = self._by_disco.get(sender)
        if node_key is None or node_key != src_node_key:
            return []
        match message:
            case Ping(tx_id, _):
                # Answered through the relay; the pong's source is DERP's magic address.
                pong = Pong(tx_id, ("127.3.3.40", region))
                return [SendDerp(region, node_key, self._seal(sender, pong))]
            case CallMeMaybe(endpoints):
                path = self._path(node_key)
                path.extra_endpoints.update(endpoints)
                return self._ping_all(node_key, now)
            case Pong():
                return []

    def tick(self, now: float, active: Sequence[bytes]) -> list[Action]:
        """Periodic work: expire paths and pings, heartbeat and discover for ``active`` peers."""
        actions: list[Action] = []
        for tx_id, sent in list(self._pings.items()):
            if now - sent.at > PING_TIMEOUT:
                del self._pings[tx_id]
        for key, path in self._paths.items():
            if path.addr is not None and now >= path.trusted_until:
                log.info("direct path lost; back to DERP", peer=key.hex()[:8], addr=_show(path.addr))
                path.addr = None
                actions.append(SetDirect(key, None))
        for key in active:
            if key not in self._peers:
                continue
            path = self._path(key)
            interval = HEARTBEAT_SECONDS if path.addr is not None else DISCOVERY_INTERVAL
            if now - path.last_ping >= interval:
                actions += self._ping_all(key, now)
                if path.addr is None and self.endpoints:
                    peer = self._peers[key]
                    actions.append(SendDerp(peer.derp_region, key,
                                            self._seal(peer.disco_key, CallMeMaybe(self.endpoints))))
        return actions

    # -- internals --

    def _path(self, node_key: bytes) -> _Path:
        return self._paths.setdefault(node_key, _Path())

    def _can_seal(self, peer_disco: bytes) -> bool:
        """False for a disco key no box can be made with (all zeros, a low-order point): such a
        peer stays on DERP."""
        try:
            seal(self._private, peer_disco, b"")
        except CryptoError:
            return False
        return True

    def _seal(self, peer_disco: bytes, message: Message) -> bytes:
        return seal_packet(self._private, self._public, peer_disco, message)

    def _ping_all(self, node_key: bytes, now: float) -> list[Action]:
        peer = self._peers[node_key]
        path = self._path(node_key)
        path.last_ping = now
        targets = dict.fromkeys((*peer.endpoints, *sorted(path.extra_endpoints)))
        actions: list[Action] = []
        for addr in targets:
            tx_id = os.urandom(TX_ID_LEN)
            self._pings[tx_id] = _SentPing(node_key, addr, now)
            actions.append(SendUdp(addr, self._seal(peer.disco_key, Ping(tx_id, self._node_public))))
        return actions

    def _on_pong(self, node_key: bytes, tx_id: bytes, src: Addr, now: float) -> list[Action]:
        sent = self._pings.pop(tx_id, None)
        if sent is None or sent.node_key != node_key or sent.addr != src:
            return []
        latency = now - sent.at
        path = self._path(node_key)
        actions: list[Action] = [NoteSource(src, node_key)]
        better = path.addr is None or now >= path.trusted_until or latency < path.latency * 0.8
        if path.addr == src or better:
            if path.addr != src:
                log.info("direct path", peer=node_key.hex()[:8], addr=_show(src), latency_ms=round(latency * 1000, 2))
                actions.append(SetDirect(node_key, src))
            path.addr, path.latency = src, latency
            path.trusted_until = now + TRUST_SECONDS
        return actions


def _show(addr: Addr) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
