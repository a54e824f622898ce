"""The client side of the DERP connection handshake (sans-IO).

Sequence (``derphttp_client.go`` ``connect``, ``derp_client.go`` ``NewClient``, Headscale
``derp_server.go`` ``servePlain``)::

    client: GET /derp HTTP/1.1, Upgrade: DERP, Connection: Upgrade
    server: HTTP/1.1 101 Switching Protocols (Derp-Version, Derp-Public-Key headers)
    server: FrameServerKey   magic "DERP🔑" + 32-byte server key
    client: FrameClientInfo  our node public key + nonce + box(JSON) sealed to the server key
    server: FrameServerInfo  nonce + box(JSON) sealed to our node key

Go's client returns as soon as ClientInfo is written; this one also waits for ServerInfo, because
a server that verifies clients (Headscale's default) closes the connection instead of sending it,
and that is the only signal of a rejected node key. Fast start (``Derp-Fast-Start: 1``, no 101)
needs the server key from a TLS "meta certificate", which Headscale does not serve, so it is not used.

Feed received bytes to :meth:`ClientHandshake.receive_data`, send :meth:`data_to_send`, and once
``state`` is ``ESTABLISHED`` hand :meth:`trailing_data` (bytes past ServerInfo) to the frame codec.
"""

from __future__ import annotations

from enum import Enum

from . import frames as f
from .errors import ProtocolError, UpgradeRefused

MAX_RESPONSE_HEAD = 16 << 10
"""Largest HTTP response head (status line + headers) accepted: 16 KiB."""


class HandshakeState(Enum):
    AWAITING_UPGRADE = "awaiting 101 Switching Protocols"
    AWAITING_SERVER_KEY = "awaiting ServerKey"
    AWAITING_SERVER_INFO = "awaiting ServerInfo"
    ESTABLISHED = "established"


def upgrade_request(host: str, *, path: str = "/derp") -> bytes:
    """The HTTP/1.1 upgrade request. ``host`` becomes the Host header; like Go's client (which
    requests ``https://<HostName>/derp``) it carries no port."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tailnet-agent\r\n"
            "Upgrade: DERP\r\nConnection: Upgrade\r\n\r\n").encode("ascii")


def parse_upgrade_response(head: bytes, rest: bytes = b"") -> dict[str, str]:
    """Check an HTTP response head (without the blank line) is a 101; return lower-cased headers.

    Raises :class:`UpgradeRefused` for any other status; ``rest`` (bytes after the head) is shown
    as the body in that error.
    """
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isascii() and parts[1].isdigit()):
        raise ProtocolError(f"not an HTTP response: {lines[0][:80]!r}")
    status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if status != 101:
        raise UpgradeRefused(status, reason, rest)
    if headers.get("upgrade", "").lower() != "derp":
        raise ProtocolError(f"101 response upgrades to {headers.get('upgrade')!r}, not DERP")
    return headers


class ClientHandshake:
    """Drives one handshake. ``private_key`` is the raw 32-byte node private key.

    ``client_info`` defaults to ``{"version":2,"CanAckPings":true}``.
    """

    def __init__(self, private_key: bytes, *, host: str, client_info: f.ClientInfo | None = None) -> None:
        if len(private_key) != f.KEY_LEN:
            raise ValueError("the node private key has 32 bytes")
        self._private_key = private_key
        self.public_key = f.public_key_of(private_key)
        self.host = host
        self.client_info = client_info or f.ClientInfo()
        self.state = HandshakeState.AWAITING_UPGRADE
        self.response_headers: dict[str, str] = {}
        self.server_key: bytes | None = None
        self.server_info: f.ServerInfo | None = None
        self._head = bytearray()
        self._decoder = f.FrameDecoder(max_frame_len=f.MAX_SERVER_KEY_FRAME_LEN)
        self._outgoing = bytearray(upgrade_request(host))

    def data_to_send(self) -> bytes:
        """Bytes to write now (no I/O is done here); empty when there is nothing."""
        out, self._outgoing = bytes(self._outgoing), bytearray()
        return out

    def receive_data(self, data: bytes) -> None:
        """Consume bytes from the server; advances ``state``. Raises a ``DerpError`` on violations."""
        if self.state is HandshakeState.ESTABLISHED:
            raise ProtocolError("handshake already complete; give further bytes to the frame codec")
        if self.state is HandshakeState.AWAITING_UPGRADE:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_RESPONSE_HEAD:
                    raise ProtocolError(f"HTTP response head longer than {MAX_RESPONSE_HEAD} bytes")
                return
            head, data = bytes(self._head[:end]), bytes(self._head[end + 4:])
            self._head.clear()
            self.response_headers = parse_upgrade_response(head, data)
            self.state = HandshakeState.AWAITING_SERVER_KEY
        self._decoder.push(data)
        while self.state is not HandshakeState.ESTABLISHED and (frame := self._decoder.next_frame()) is not None:
            self._on_frame(frame)

    def trailing_data(self) -> bytes:
        """Bytes received after ServerInfo; they belong to the steady-state frame stream."""
        return self._decoder.pending()

    def _on_frame(self, frame: f.Frame) -> None:
        if self.state is HandshakeState.AWAITING_SERVER_KEY:
            self.server_key = f.parse_server_key(frame)
            self._outgoing += f.encode_client_info(self._private_key, self.server_key, self.client_info)
            self.state = HandshakeState.AWAITING_SERVER_INFO
            # ServerInfo is sealed JSON of at most MAX_INFO_LEN; later frames may be up to 1 MiB.
            self._decoder.max_frame_len = f.MAX_FRAME_LEN
        elif self.state is HandshakeState.AWAITING_SERVER_INFO:
            assert self.server_key is not None
            if frame.type != f.FrameType.SERVER_INFO:
                raise ProtocolError(f"expected ServerInfo after ClientInfo, got frame type 0x{frame.type:02x}")
            self.server_info = f.parse_server_info(self._private_key, self.server_key, frame)
            self.state = HandshakeState.ESTABLISHED
