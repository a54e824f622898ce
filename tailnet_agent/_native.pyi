"""Type stub for the Rust extension ``tailnet_agent._native`` (crate ``native/``).

Sans-IO data plane: the caller feeds DERP bytes (``derp_feed``) and the time (``poll``);
``poll`` returns DERP bytes to write, events and the next deadline. Call ``poll`` after
every batch of calls (feeding, sends, connects) and again at ``next_deadline`` at the latest.
Time is any monotonic clock in seconds (e.g. ``time.monotonic()``), the same for every call.
"""

from collections.abc import Sequence
from typing import Final, TypeAlias, final

DEFAULT_TCP_BUFFER_SIZE: Final[int]
MTU: Final[int]

__all__ = [
    "DEFAULT_TCP_BUFFER_SIZE",
    "MTU",
    "Accepted",
    "Closed",
    "Connected",
    "DataPlane",
    "DerpFrame",
    "DerpHealth",
    "DerpPeerGone",
    "DerpPeerPresent",
    "DerpRestarting",
    "DialFailed",
    "DiscoDerp",
    "DiscoUdp",
    "PeerClosed",
    "PollResult",
    "Readable",
    "Reset",
    "StunUdp",
    "Writable",
]

@final
class Connected:
    """An outbound connection (tcp_connect) completed its handshake."""

    __match_args__ = ("handle",)
    @property
    def handle(self) -> int: ...

@final
class Readable:
    """Data is waiting; re-armed by each tcp_recv call on the handle."""

    __match_args__ = ("handle",)
    @property
    def handle(self) -> int: ...

@final
class Writable:
    """Send-buffer space freed up after a short tcp_send."""

    __match_args__ = ("handle",)
    @property
    def handle(self) -> int: ...

@final
class PeerClosed:
    """The peer sent FIN and everything before it has been read (EOF); writing still works."""

    __match_args__ = ("handle",)
    @property
    def handle(self) -> int: ...

@final
class Closed:
    """Both directions closed gracefully; the handle is released."""

    __match_args__ = ("handle",)
    @property
    def handle(self) -> int: ...

@final
class Reset:
    """The connection was reset or timed out; the handle is released."""

    __match_args__ = ("handle",)
    @property
    def handle(self) -> int: ...

@final
class Accepted:
    """A listener accepted a connection with a new ``handle``."""

    __match_args__ = ("listener", "handle", "remote_ip", "remote_port")
    @property
    def listener(self) -> int: ...
    @property
    def handle(self) -> int: ...
    @property
    def remote_ip(self) -> str: ...
    @property
    def remote_port(self) -> int: ...

@final
class DialFailed:
    """tcp_connect failed (e.g. ``"no route to 100.64.0.9: ..."``, ``"connection timed out"``,
    ``"connection refused (reset by peer)"``); the handle is released."""

    __match_args__ = ("handle", "reason")
    @property
    def handle(self) -> int: ...
    @property
    def reason(self) -> str: ...

@final
class DerpPeerGone:
    __match_args__ = ("region", "key", "reason")
    @property
    def region(self) -> int: ...
    @property
    def key(self) -> bytes: ...
    @property
    def reason(self) -> int: ...

@final
class DerpPeerPresent:
    __match_args__ = ("region", "key")
    @property
    def region(self) -> int: ...
    @property
    def key(self) -> bytes: ...

@final
class DerpHealth:
    __match_args__ = ("region", "message")
    @property
    def region(self) -> int: ...
    @property
    def message(self) -> str: ...

@final
class DerpRestarting:
    __match_args__ = ("region", "reconnect_in_ms", "try_for_ms")
    @property
    def region(self) -> int: ...
    @property
    def reconnect_in_ms(self) -> int: ...
    @property
    def try_for_ms(self) -> int: ...

@final
class DerpFrame:
    """A DERP frame the data plane does not handle (ServerKey, ServerInfo, unknown types)."""

    __match_args__ = ("region", "frame_type", "payload")
    @property
    def region(self) -> int: ...
    @property
    def frame_type(self) -> int: ...
    @property
    def payload(self) -> bytes: ...

@final
class DiscoDerp:
    """A sealed disco message relayed by DERP ``region`` from the peer ``key``."""

    __match_args__ = ("region", "key", "payload")
    @property
    def region(self) -> int: ...
    @property
    def key(self) -> bytes: ...
    @property
    def payload(self) -> bytes: ...

@final
class DiscoUdp:
    """A sealed disco message that arrived on the UDP socket."""

    __match_args__ = ("src_ip", "src_port", "payload")
    @property
    def src_ip(self) -> str: ...
    @property
    def src_port(self) -> int: ...
    @property
    def payload(self) -> bytes: ...

@final
class StunUdp:
    """A STUN message from the UDP socket (a DERP node's binding response)."""

    __match_args__ = ("src_ip", "src_port", "payload")
    @property
    def src_ip(self) -> str: ...
    @property
    def src_port(self) -> int: ...
    @property
    def payload(self) -> bytes: ...

Event: TypeAlias = (
    Connected
    | Readable
    | Writable
    | PeerClosed
    | Closed
    | Reset
    | Accepted
    | DialFailed
    | DerpPeerGone
    | DerpPeerPresent
    | DerpHealth
    | DerpRestarting
    | DerpFrame
    | DiscoDerp
    | DiscoUdp
    | StunUdp
)

# (node public key (32 bytes), AllowedIPs prefixes, home DERP region id)
PeerSpec: TypeAlias = tuple[bytes, Sequence[str], int]
# One compiled Tailscale FilterRule:
#   (SrcIPs: "*", IP, CIDR or "a-b" range ("cap:..." entries are ignored),
#    DstPorts: [(IP/CIDR/range/"*", first_port, last_port)],
#    IPProto: IP protocol numbers; empty means TCP, UDP, ICMP and ICMPv6)
FilterRule: TypeAlias = tuple[Sequence[str], Sequence[tuple[str, int, int]], Sequence[int]]

@final
class PollResult:
    @property
    def derp_writes(self) -> list[tuple[int, bytes]]:
        """One batched buffer of DERP frames per region, to write to that region's relay."""
    @property
    def udp_pending(self) -> int:
        """Datagrams queued for the UDP socket (WireGuard over direct paths); see udp_send."""
    @property
    def events(self) -> list[Event]: ...
    @property
    def next_deadline(self) -> float | None:
        """Time (same clock as ``now``) by which poll must run again; None: only on input."""
    @property
    def counters(self) -> dict[str, int]:
        """Cumulative: packets_in/out, bytes_in/out, derp_*, and drop_<reason> counts."""

@final
class DataPlane:
    """One tailnet node's data plane. Use from a single thread."""

    def __new__(cls, private_key: bytes, *, tcp_buffer_size: int = ...) -> DataPlane:
        """``private_key``: the node's X25519 private key (32 bytes). ``tcp_buffer_size``:
        receive and send buffer per TCP connection (default 512 KiB each)."""
    @property
    def public_key(self) -> bytes: ...
    def set_private_key(self, private_key: bytes) -> None:
        """Switch to a new node private key (control rotated it): WireGuard sessions restart
        with it; TCP connections stay."""
    def set_self(self, addresses: Sequence[str]) -> None:
        """The node's addresses, e.g. ["100.64.0.5/32", "fd7a:115c:a1e0::5/128"]
        (at most one IPv4 and one IPv6)."""
    def set_shared(self, addresses: Sequence[str]) -> None:
        """Shared host addresses (at most one IPv4 and one IPv6) answered as the node's own besides
        its tailnet addresses: an address several nodes advertise as a route, which control gives
        to one of them at a time. Listeners accept on them; dials keep the node's own source."""
    def set_peers(self, peers: Sequence[PeerSpec]) -> None:
        """Replace the peer set; peers whose key is unchanged keep their WireGuard session. A prefix
        two peers claim routes to the earlier one in ``peers``."""
    def upsert_peers(self, peers: Sequence[tuple[int, PeerSpec]]) -> None:
        """Add or update peers given as ``(rank, spec)``; every other peer stays as it is, and an
        updated one keeps its WireGuard session and direct path. A prefix two peers claim routes to
        the lower rank (the agent passes the node id, the order ``set_peers`` gets them in).
        Nothing changes when a spec does not parse (ValueError)."""
    def remove_peers(self, keys: Sequence[bytes]) -> None:
        """Remove the peers with these node keys (unknown ones are ignored); a prefix one of them
        routed goes to the next peer claiming it, if any."""
    def set_filter(self, rules: Sequence[FilterRule]) -> None:
        """Inbound packet filter. Until first set, every new inbound flow is denied."""
    def derp_feed(self, region: int, chunk: bytes) -> None:
        """Bytes read from ``region``'s relay after its handshake. Raises ConnectionError
        when the stream is corrupt (reconnect, then call derp_reset)."""
    def derp_send(self, region: int, key: bytes, payload: bytes) -> None:
        """Queue ``payload`` (a sealed disco message) for the peer ``key`` through DERP ``region``."""
    def udp_feed(self, src_ip: str, src_port: int, datagram: bytes) -> None:
        """Feed one UDP datagram (tests; the agent uses udp_receive)."""
    def udp_receive(self, fd: int, max_reads: int = 1024) -> int:
        """Read from the non-blocking UDP socket ``fd`` (the caller owns it; GRO-coalesced reads are
        split) into the data plane; returns the datagrams read. Disco becomes DiscoUdp events; poll
        afterwards."""
    def udp_send(self, fd: int) -> int:
        """Send queued datagrams on ``fd`` until it would block (GSO batches where the kernel has
        them); returns how many are left."""
    def set_peer_direct(self, key: bytes, addr: tuple[str, int] | None) -> bool:
        """Send WireGuard for the peer ``key`` over UDP to ``addr``, or through DERP with None.
        False for an unknown peer."""
    def note_udp_source(self, ip: str, port: int, key: bytes) -> None:
        """UDP datagrams from (ip, port) come from the peer ``key``."""
    def active_peers(self, since: float) -> list[bytes]:
        """Node keys of peers an IP packet was sent to at or after ``since``."""
    def derp_reset(self, region: int) -> None:
        """Drop a partial frame buffered for ``region`` (new connection)."""
    def poll(self, now: float) -> PollResult: ...
    def counters(self) -> dict[str, int]: ...
    def tcp_connect(self, dst_ip: str, dst_port: int, timeout: float = 30.0) -> int:
        """Start a connection; the outcome is a Connected or DialFailed event."""
    def tcp_listen(self, port: int) -> int:
        """Listen on all node addresses; each connection arrives as an Accepted event.
        Raises OSError(EADDRINUSE) when the port already has a listener."""
    def tcp_unlisten(self, listener: int) -> None: ...
    def tcp_send(self, handle: int, data: bytes | bytearray | memoryview) -> int:
        """Queue bytes from any contiguous buffer (not copied first); returns how many were accepted
        (0 while connecting). A short count means the buffer is full: wait for Writable.
        BrokenPipeError after shutdown."""
    def tcp_recv(self, handle: int, max_bytes: int = 262144) -> bytes:
        """Read buffered bytes (b"" when none; EOF is the PeerClosed event)."""
    def tcp_shutdown_write(self, handle: int) -> None:
        """Send FIN after queued data (half-close); reading continues."""
    def tcp_close(self, handle: int) -> None:
        """Release the handle: FIN if all received data was read, else RST. Idempotent."""
    def tcp_abort(self, handle: int) -> None:
        """Release the handle and reset the connection. Idempotent."""
    def tcp_endpoints(self, handle: int) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
        """(local, remote) address of a connection."""
    def send_ip_packets(self, packets: Sequence[bytes]) -> None:
        """Route raw IP packets into the tunnel like stack traffic (drops counted)."""
