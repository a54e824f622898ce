"""Errors of the DERP client. One base class; the tree::

    DerpError
    ├── ProtocolError            the peer broke the DERP framing or handshake rules
    │   ├── FrameTooLarge        a frame header announced more than the limit
    │   ├── MalformedFrame       a frame too short for its type (skipped by the connection)
    │   └── BadServerKey         the first frame was not a valid ServerKey greeting
    ├── PacketTooLarge           a packet to send exceeds ``MAX_PACKET_SIZE`` (64 KiB)
    ├── CryptoError              a NaCl box did not open (wrong key or tampered)
    └── DerpConnectError         connecting failed; the supervisor retries these
        ├── DerpTLSError         TLS handshake failed (e.g. certificate not trusted)
        ├── UpgradeRefused       the HTTP upgrade was answered with a status other than 101
        ├── HandshakeRejected    the server closed the connection after our ClientInfo
        └── ConnectionLost       the stream ended or timed out (also after the handshake)
"""

from __future__ import annotations


class DerpError(Exception):
    """Base of every error raised by ``tailnet_agent.derp``."""


class ProtocolError(DerpError):
    """The byte stream does not follow the DERP protocol."""


class FrameTooLarge(ProtocolError):
    """A frame header announced a length above the decoder's limit."""

    def __init__(self, frame_type: int, length: int, limit: int) -> None:
        super().__init__(f"frame type 0x{frame_type:02x} announces {length} bytes, above the limit of {limit}")
        self.frame_type = frame_type
        self.length = length
        self.limit = limit


class MalformedFrame(ProtocolError):
    """A frame whose payload is too short (or otherwise invalid) for its type."""


class BadServerKey(ProtocolError):
    """The server's greeting was not ``FrameServerKey`` with the ``DERP🔑`` magic."""


class PacketTooLarge(DerpError):
    """A packet to send is larger than ``MAX_PACKET_SIZE``."""


class CryptoError(DerpError):
    """A NaCl box could not be opened."""


class DerpConnectError(DerpError):
    """Connecting to a DERP node failed; retryable."""


class DerpTLSError(DerpConnectError):
    """The TLS handshake with the DERP node failed."""


class UpgradeRefused(DerpConnectError):
    """The server answered ``GET /derp`` with something other than ``101 Switching Protocols``."""

    def __init__(self, status: int, reason: str, body: bytes = b"") -> None:
        detail = f": {body[:200]!r}" if body else ""
        super().__init__(f"DERP upgrade refused with HTTP {status} {reason}{detail}")
        self.status = status
        self.reason = reason
        self.body = body


class HandshakeRejected(DerpConnectError):
    """The server closed the connection after ClientInfo instead of sending ServerInfo.

    A server with client verification (Headscale's ``derp.server.verify_clients``, default true)
    does this when the node key does not belong to a registered node.
    """


class ConnectionLost(DerpConnectError):
    """The connection ended (EOF, reset) or no byte arrived within the read timeout."""
